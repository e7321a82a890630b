"""The tower beyond what the golden covers — several packed items, videos of t > 1 frames — against an
independent NumPy implementation of the official forward (written from its description: per-item
loops, complex-number RoPE, float64), with random weights at fp32. Also the pieces that the golden
pins only weakly: the bilinear resize without antialiasing and the rotary order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import K3Config
from k3jax.vision.position import frame_embedding, resize_table, rope_tables
from k3jax.vision.tower import VisionTower
from tests.conftest import GOLDEN_DIR, rel_rms

GRIDS = ((2, 4, 6), (1, 2, 2), (3, 6, 4))  # a 2-frame video, a small image, a 3-frame video, packed


def np_bilinear(table: np.ndarray, h: int, w: int) -> np.ndarray:
    """torch F.interpolate(bilinear, align_corners=False), one output pixel at a time."""
    h0, w0, _ = table.shape

    def taps(i, out, size):
        src = max((i + 0.5) * size / out - 0.5, 0.0)
        low = int(math.floor(src))
        return low, min(low + 1, size - 1), src - low

    out = np.empty((h, w, table.shape[2]))
    for r in range(h):
        r0, r1, a = taps(r, h, h0)
        for c in range(w):
            c0, c1, b = taps(c, w, w0)
            out[r, c] = ((1 - a) * ((1 - b) * table[r0, c0] + b * table[r0, c1])
                         + a * ((1 - b) * table[r1, c0] + b * table[r1, c1]))
    return out.reshape(h * w, -1)


def np_tower(weights: dict, cfg, pixels: np.ndarray, grids) -> np.ndarray:
    d, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    eps = np.finfo(np.float32).eps

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    freqs = 10000.0 ** (-4 * np.arange(hd // 4) / hd)
    out, offset = [], 0
    for t, h, w in grids:
        n = t * h * w
        x = pixels[offset:offset + n].reshape(n, -1) @ weights["proj"].reshape(d, -1).T
        pos = np_bilinear(weights["pos"], h, w)
        if t > 1:
            omega = 10000.0 ** (-np.arange(d // 2) / (d / 2))
            frames = np.concatenate([np.sin(np.arange(t)[:, None] * omega), np.cos(np.arange(t)[:, None] * omega)], 1)
            pos = (pos[None] + frames[:, None]).reshape(n, d)
        x = x + pos
        rows, cols = np.divmod(np.arange(h * w), w)
        turn = np.exp(1j * np.stack([cols[:, None] * freqs, rows[:, None] * freqs], -1).reshape(h * w, hd // 2))
        turn = np.tile(turn, (t, 1))[:, None, :]  # every frame rotates alike

        def rope(z):
            c = (z[..., 0::2] + 1j * z[..., 1::2]) * turn
            return np.stack([c.real, c.imag], -1).reshape(z.shape)

        for blk in weights["blocks"]:
            qkv = (norm(x, blk["norm0"]) @ blk["wqkv"].T).reshape(n, 3, heads, hd)
            q, k, v = rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]
            s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, -1) @ blk["wo"].T
            x = x + gelu_tanh(norm(x, blk["norm1"]) @ blk["fc0"].T) @ blk["fc1"].T
        x = norm(x, weights["final"]).reshape(t, h // 2, 2, w // 2, 2, d).transpose(0, 1, 3, 2, 4, 5).mean(0)
        out.append(x.reshape((h // 2) * (w // 2), 4 * d))
        offset += n
    return np.concatenate(out)


def test_packed_items_and_videos_match_an_independent_reference():
    cfg = K3Config.from_hf(GOLDEN_DIR).vision
    tower = VisionTower(cfg, dtype=jnp.float32, rngs=nnx.Rngs(7))
    f64 = lambda p: np.asarray(p[...], np.float64)  # noqa: E731
    weights = {
        "proj": f64(tower.patch_embed.proj.weight), "pos": f64(tower.patch_embed.pos_emb.weight),
        "final": f64(tower.encoder.final_layernorm.weight),
        "blocks": [{"norm0": f64(b.norm0.weight), "wqkv": f64(b.wqkv.weight), "wo": f64(b.wo.weight),
                    "norm1": f64(b.norm1.weight), "fc0": f64(b.mlp.fc0.weight), "fc1": f64(b.mlp.fc1.weight)}
                   for b in tower.encoder.blocks],
    }
    length = sum(t * h * w for t, h, w in GRIDS)
    pixels = np.random.default_rng(0).uniform(-1, 1, (length, 3, 14, 14)).astype(np.float32)
    actual = jax.jit(lambda m, x: m(x, GRIDS))(tower, jnp.asarray(pixels))
    expected = np_tower(weights, cfg, pixels.astype(np.float64), GRIDS)
    assert actual.shape == expected.shape == (6 + 1 + 6, 4 * cfg.hidden_size)
    assert rel_rms(actual, expected) < 1e-5


@pytest.mark.parametrize("size", [(4, 6), (2, 2), (3, 13), (16, 8), (8, 8)])
def test_position_table_is_resized_bilinearly_without_antialiasing(size):
    table = np.random.default_rng(1).normal(size=(8, 8, 5)).astype(np.float32)
    actual = np.asarray(resize_table(jnp.asarray(table), *size))
    np.testing.assert_allclose(actual, np_bilinear(table.astype(np.float64), *size), rtol=0, atol=1e-5)
    if size[0] < 8:  # the trap: JAX's default (antialiased) resize is another filter when shrinking
        smooth = jax.image.resize(table, (*size, 5), method="bilinear").reshape(-1, 5)
        assert np.abs(np.asarray(smooth) - actual).max() > 1e-2


def test_rotary_turns_columns_first_then_rows():
    cos, sin = rope_tables(1, 5, 16)  # one row: only column angles are non-zero
    assert np.all(sin[:, 1::2] == 0) and np.any(sin[:, 0::2] != 0)
    cos, sin = rope_tables(5, 1, 16)  # one column: only row angles
    assert np.all(sin[:, 0::2] == 0) and np.any(sin[:, 1::2] != 0)


def test_frame_embedding_is_sin_then_cos_halves():
    emb = frame_embedding(3, 8)
    np.testing.assert_array_equal(emb[0], [0, 0, 0, 0, 1, 1, 1, 1])  # frame 0 still adds the cos half
    np.testing.assert_allclose(emb[2, [0, 4]], [math.sin(2), math.cos(2)], rtol=1e-6)
