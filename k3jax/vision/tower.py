"""MoonViT-V2: the vision tower of Kimi K3, exact to the official code.

    patches [L, 3, p, p] -> linear patch embedding + learned 2-D position table (bilinearly resized
    to each grid; + a fixed frame embedding for multi-frame items) -> pre-norm blocks (2-D RoPE
    attention within each item, tanh-GELU MLP) -> final norm -> 2x2 merge, averaged over frames
    -> [sum of (h/2)(w/2), 4 * D]

Quirks kept from the official code: the tower's RMSNorms have no configured eps, so they use the
machine epsilon of the activation dtype; the MLP is tanh-GELU whatever `activation_func` says.
Attribute names follow the release's tensor names (`vision_tower.encoder.blocks.0.wqkv.weight`).
Items (an image, or up to `pos_emb_time` frames of a video) are packed without padding and
described by static grids (t, h, w) in patches, frame-major then row-major.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import VisionConfig
from k3jax.nn.layers import F32, Linear, RMSNorm, declare, linear, normal_init
from k3jax.vision.attention import item_attention
from k3jax.vision.position import apply_rope, frame_embedding, resize_table, rope_tables

Grid = tuple[int, int, int]  # (frames, rows, columns) of one item, in patches


def gelu(x: jax.Array, *, approximate: bool) -> jax.Array:
    """GELU computed in float32 and rounded to x's dtype, as torch's elementwise kernels do."""
    return jax.nn.gelu(x.astype(F32), approximate=approximate).astype(x.dtype)


class PatchEmbed(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        p, d = cfg.patch_size, cfg.hidden_size
        self.proj = nnx.Module()
        self.proj.weight = declare(rngs, (d, 3, p, p), dtype, (None, None, None, None),
                                   normal_init(1 / (3 * p * p) ** 0.5))
        self.pos_emb = nnx.Module()
        self.pos_emb.weight = declare(rngs, (cfg.pos_emb_height, cfg.pos_emb_width, d), dtype, (None, None, None),
                                      normal_init(0.5))
        self.max_frames = cfg.pos_emb_time

    def __call__(self, pixels: jax.Array, grids: tuple[Grid, ...]) -> jax.Array:
        weight = self.proj.weight[...]
        x = linear(pixels.astype(weight.dtype).reshape(pixels.shape[0], -1), weight.reshape(weight.shape[0], -1))
        table = self.pos_emb.weight[...]
        pos = []
        for t, h, w in grids:
            spatial = resize_table(table, h, w).astype(x.dtype)
            if t == 1:
                pos.append(spatial)
            else:  # multi-frame items also get the fixed frame embedding, frame 0 included
                frames = jnp.asarray(frame_embedding(t, x.shape[-1]), x.dtype)
                pos.append((spatial[None] + frames[:, None]).reshape(t * h * w, -1))
        return x + jnp.concatenate(pos)


class MLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.fc0 = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, axes=("mlp", None), rngs=rngs)
        self.fc1 = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, axes=(None, "mlp"), rngs=rngs, gain=0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc1(gelu(self.fc0(x), approximate=True))


class Block(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, attention: str | None) -> None:
        d, eps = cfg.hidden_size, float(jnp.finfo(dtype).eps)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = RMSNorm(d, eps, dtype=dtype, axis=None, rngs=rngs)
        self.wqkv = Linear(d, 3 * cfg.qkv_hidden_size, dtype=dtype, axes=(None, None), rngs=rngs)
        self.wo = Linear(cfg.qkv_hidden_size, d, dtype=dtype, axes=(None, None), rngs=rngs, gain=0.5)
        self.norm1 = RMSNorm(d, eps, dtype=dtype, axis=None, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.attention = attention  # static: the attention implementation (None: dispatch policy)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, lengths: tuple[int, ...]) -> jax.Array:
        qkv = self.wqkv(self.norm0(x)).reshape(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = apply_rope(qkv[:, 0], cos, sin), apply_rope(qkv[:, 1], cos, sin), qkv[:, 2]
        out = item_attention(q, k, v, lengths, self.attention)
        x = x + self.wo(out.reshape(x.shape[0], -1))
        return x + self.mlp(self.norm1(x))


class Encoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, attention: str | None) -> None:
        self.blocks = nnx.List([Block(cfg, dtype=dtype, rngs=rngs, attention=attention)
                                for _ in range(cfg.num_layers)])
        self.final_layernorm = RMSNorm(cfg.hidden_size, float(jnp.finfo(dtype).eps), dtype=dtype, axis=None, rngs=rngs)


class VisionTower(nnx.Module):
    """MoonViT-V2 (`vision_tower.*`): patches -> merged patch features [tokens, 4 * hidden]."""

    def __init__(self, cfg: VisionConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, attention: str | None = None) -> None:
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs, attention=attention)

    def use_attention(self, implementation: str | None) -> None:
        """Run attention with another implementation of `k3jax.vision.attention` (None: the policy);
        the next jitted call compiles for it."""
        for block in self.encoder.blocks:
            block.attention = implementation

    def encode(self, pixels: jax.Array, grids: tuple[Grid, ...]) -> jax.Array:
        """pixel_values [L, 3, p, p] -> per-patch features after the final norm [L, hidden]."""
        x = self.patch_embed(pixels, grids)
        tables = [rope_tables(h, w, self.config.head_dim) for _, h, w in grids]
        cos = jnp.asarray(np.concatenate([np.tile(c, (t, 1)) for (t, _, _), (c, _) in zip(grids, tables)]))
        sin = jnp.asarray(np.concatenate([np.tile(s, (t, 1)) for (t, _, _), (_, s) in zip(grids, tables)]))
        lengths = tuple(t * h * w for t, h, w in grids)
        for block in self.encoder.blocks:
            x = block(x, cos, sin, lengths)
        return self.encoder.final_layernorm(x)

    def __call__(self, pixels: jax.Array, grids: tuple[Grid, ...]) -> jax.Array:
        """pixel_values [L, 3, p, p] -> merged features [sum (h/2)(w/2), 4 * hidden]: each row the
        2x2 window's four patch features in (row, column) order, averaged over the item's frames."""
        x = self.encode(pixels, grids)
        merged, offset = [], 0
        for t, h, w in grids:
            item = x[offset:offset + t * h * w].reshape(t, h // 2, 2, w // 2, 2, -1)
            item = item.transpose(0, 1, 3, 2, 4, 5).astype(F32).mean(axis=0).astype(x.dtype)
            merged.append(item.reshape((h // 2) * (w // 2), -1))
            offset += t * h * w
        return jnp.concatenate(merged)
