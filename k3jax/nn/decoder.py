"""One K3 decoder layer: AttnRes mix -> norm -> mixer, AttnRes mix -> norm -> FFN, with the block schedule.

Schedule per layer l (block size S, k3-architecture.md §2.2):
  x = mix(bank + prefix)            (at l = 0 only the embeddings exist, so the mix is the identity)
  if l % S == 0: push prefix to the bank, start an empty block
  prefix += mixer(input_layernorm(x))
  x = mix(bank + prefix);  prefix += ffn(post_attention_layernorm(x))
`layer_index` may be a traced scalar, so the same code runs unrolled or inside a `lax.scan`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import FfnKind, K3Config, MixerKind
from k3jax.kernels import Kernels
from k3jax.nn.attn_res import AttnResStream, attn_res_mix
from k3jax.nn.kda import KDACache, KimiDeltaAttention
from k3jax.nn.layers import Linear, RMSNorm
from k3jax.nn.mla import GatedMLA, MLACache
from k3jax.nn.moe import LatentMoE, RouterStats
from k3jax.nn.situ import SiTUMLP

LayerCache = KDACache | MLACache


class LayerTaps(NamedTuple):
    """Intermediate values of one layer, for layer-by-layer checks against the reference."""

    attn_in: jax.Array
    attn_out: jax.Array
    mlp_in: jax.Array
    mlp_out: jax.Array
    router_ids: jax.Array | None
    router_stats: RouterStats | None = None  # MoE layers, when asked for (training's balancing)


class DecoderLayer(nnx.Module):
    def __init__(
        self, cfg: K3Config, mixer: MixerKind, ffn: FfnKind, *, dtype: jnp.dtype, rngs: nnx.Rngs,
        kernels: Kernels = Kernels(),
    ) -> None:
        """One layer of `mixer` and `ffn` kinds; `kernels` picks the KDA, MLA and routed-expert kernels."""
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attention_res_proj = Linear(d, 1, dtype=dtype, axes=(None, "embed"), rngs=rngs)
        self.self_attention_res_norm = RMSNorm(d, eps, dtype=dtype, axis="embed", rngs=rngs)
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype, axis="embed", rngs=rngs)
        if mixer == "kda":
            self.self_attn = KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        else:
            self.self_attn = GatedMLA(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        self.mlp_res_proj = Linear(d, 1, dtype=dtype, axes=(None, "embed"), rngs=rngs)
        self.mlp_res_norm = RMSNorm(d, eps, dtype=dtype, axis="embed", rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype, axis="embed", rngs=rngs)
        if ffn == "dense":
            self.mlp = SiTUMLP(d, cfg.intermediate_size, cfg.situ_beta, cfg.situ_linear_beta, dtype=dtype,
                               mlp_axis="mlp", rngs=rngs)
        else:
            self.block_sparse_moe = LatentMoE(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        self.mixer_kind, self.ffn_kind = mixer, ffn
        self.kernels = kernels
        self.block_size, self.eps = cfg.attn_res_block_size, eps
        # Static: a `jax.checkpoint_policies` name under which cache-free passes rematerialise this
        # layer in the backward pass (set by training), or None.
        self.remat_policy: str | None = None

    def __call__(
        self, stream: AttnResStream, layer_index: jax.Array | int, cache: LayerCache | None = None,
        position: jax.Array | int = 0, start: jax.Array | None = None, segments: jax.Array | None = None,
        stats_valid: jax.Array | None = None, collect_router_stats: bool = False,
        real_tokens: jax.Array | None = None,
    ) -> tuple[AttnResStream, LayerCache | None, LayerTaps]:
        """`forward`, under `jax.checkpoint` with `remat_policy` when one is set and there is no cache."""
        if self.remat_policy is None or cache is not None:
            return self.forward(stream, layer_index, cache, position, start, segments, stats_valid, collect_router_stats,
                                real_tokens)

        def body(layer, stream, layer_index, position, start, segments, stats_valid):
            return layer.forward(stream, layer_index, None, position, start, segments, stats_valid, collect_router_stats)

        policy = getattr(jax.checkpoint_policies, self.remat_policy)
        return jax.checkpoint(body, policy=policy)(self, stream, layer_index, position, start, segments, stats_valid)

    def forward(
        self, stream: AttnResStream, layer_index: jax.Array | int, cache: LayerCache | None = None,
        position: jax.Array | int = 0, start: jax.Array | None = None, segments: jax.Array | None = None,
        stats_valid: jax.Array | None = None, collect_router_stats: bool = False,
        real_tokens: jax.Array | None = None,
    ) -> tuple[AttnResStream, LayerCache | None, LayerTaps]:
        """`start` int32 [B]: first real position of each row (left padding before it), or None.
        `real_tokens` int32 scalar (with a cache): the first `real_tokens` new tokens of every row are
        real, the rest right padding that leaves the KDA state and conv window as the real ones left
        them (MLA needs nothing: real queries never see the later pad keys, and the caller's cache
        length counts real tokens only, so the pads' latents are overwritten next).
        `segments` int32 [B, T]: packed documents (cache-free passes), kept apart by the mixers.
        `collect_router_stats`: MoE layers add their `RouterStats` over the tokens `stats_valid`
        (bool [B, T], None: all) to the taps."""
        attn_in = self._mix(stream, self.self_attention_res_proj, self.self_attention_res_norm)
        stream = stream.push_block_if(layer_index % self.block_size == 0)

        mixer_in = self.input_layernorm(attn_in)
        if self.mixer_kind == "kda":
            attn_out, cache = self.self_attn(mixer_in, cache, _real_steps(mixer_in.shape[:2], position, start, real_tokens),
                                             segments, real_tokens)
        else:
            attn_out, cache = self.self_attn(mixer_in, cache, position, start, segments)
        stream = stream.add(attn_out)

        mlp_in = self._mix(stream, self.mlp_res_proj, self.mlp_res_norm)
        ffn_in = self.post_attention_layernorm(mlp_in)
        stats = None
        if self.ffn_kind == "dense":
            mlp_out, router_ids = self.mlp(ffn_in), None
        else:
            mlp_out, router_ids = self.block_sparse_moe(ffn_in)
            if collect_router_stats:
                stats = self.block_sparse_moe.router_stats(ffn_in, stats_valid)
        stream = stream.add(mlp_out)
        return stream, cache, LayerTaps(attn_in, attn_out, mlp_in, mlp_out, router_ids, stats)

    def _mix(self, stream: AttnResStream, proj: Linear, norm: RMSNorm) -> jax.Array:
        return attn_res_mix(stream, proj.weight[...][0], norm.weight[...], self.eps)

    def empty_cache(self, cfg: K3Config, batch: int, capacity: int, dtype: jnp.dtype) -> LayerCache:
        if self.mixer_kind == "kda":
            return KDACache.empty(cfg, batch, dtype)
        return MLACache.empty(cfg, batch, capacity, dtype)


def _real_steps(shape: tuple[int, int], position: jax.Array | int, start: jax.Array | None,
                real_tokens: jax.Array | None) -> jax.Array | None:
    """bool [B, T]: the new tokens that are neither left padding (before `start`) nor right padding
    (from `real_tokens` on); None when there is neither."""
    if start is None and real_tokens is None:
        return None
    steps = jnp.arange(shape[1])
    valid = jnp.ones(shape, bool)
    if start is not None:
        valid &= position + steps >= start[:, None]
    if real_tokens is not None:
        valid &= steps < real_tokens
    return valid
