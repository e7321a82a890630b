"""Positions of MoonViT-V2 patches: the learned 2-D table resized to each grid, the fixed frame
embedding of videos, and the 2-D rotary tables.

Everything that depends only on a grid (interpolation indices and weights, rotary angles) is
computed on the host in float32, as the reference computes it; grids are static, so these are
constants of the compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
ROPE_THETA = 10000.0
ROPE_MAX_SIDE = 512  # the reference's rotary table covers grids up to 512 x 512 patches


def bilinear_taps(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index: the two source indices and the weight of the second, for a bilinear resize
    with align_corners=False and no antialiasing (torch's `F.interpolate(mode='bilinear')`).

    Written out rather than `jax.image.resize`, whose default antialiasing is a different filter when
    shrinking; the float32 arithmetic follows the reference's kernel: src = max((dst + 0.5) * in / out
    - 0.5, 0), the far neighbour clamped to the last index."""
    scale = np.float32(in_size) / np.float32(out_size)
    src = np.maximum((np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5),
                     np.float32(0))
    low = src.astype(np.int64)
    high = np.minimum(low + 1, in_size - 1)
    return low, high, (src - low.astype(np.float32)).astype(np.float32)


def resize_table(table: jax.Array, h: int, w: int) -> jax.Array:
    """The table [H0, W0, D] bilinearly resized to [h, w, D] (float32), flattened row-major to [h*w, D]."""
    h0, w0, d = table.shape
    t = table.astype(F32)
    if (h, w) != (h0, w0):
        r0, r1, rw = bilinear_taps(h, h0)
        c0, c1, cw = bilinear_taps(w, w0)
        rows = t[r0] * (1 - rw)[:, None, None] + t[r1] * rw[:, None, None]  # [h, W0, D]
        t = rows[:, c0] * (1 - cw)[None, :, None] + rows[:, c1] * cw[None, :, None]  # [h, w, D]
    return t.reshape(h * w, d)


def frame_embedding(frames: int, dim: int) -> np.ndarray:
    """The fixed sin-cos embedding of frame indices [frames, dim]: halves [sin(f w), cos(f w)] with
    w_j = 10000^(-j / (dim / 2)). Added to every patch of a multi-frame item (not to a single image)."""
    omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    angles = np.arange(frames, dtype=np.float64)[:, None] * omega[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


def rope_tables(h: int, w: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [h*w, head_dim / 2] of the 2-D rotary embedding, per complex channel.

    Frequencies f_i = theta^(-4i / head_dim), i < head_dim / 4; complex channel 2i turns by
    column * f_i and channel 2i + 1 by row * f_i (column first, as the reference code does)."""
    if h > ROPE_MAX_SIDE or w > ROPE_MAX_SIDE:
        raise ValueError(f"a {h} x {w} patch grid exceeds the rotary table's {ROPE_MAX_SIDE} x {ROPE_MAX_SIDE}")
    freqs = (np.float32(1.0) / np.float32(ROPE_THETA) ** (np.arange(0, head_dim, 4, dtype=np.float32)[: head_dim // 4]
                                                             / np.float32(head_dim))).astype(np.float32)
    rows, cols = np.divmod(np.arange(h * w), w)
    col_angle = cols.astype(np.float32)[:, None] * freqs[None, :]
    row_angle = rows.astype(np.float32)[:, None] * freqs[None, :]
    angles = np.stack([col_angle, row_angle], axis=-1).reshape(h * w, head_dim // 2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [L, H, hd] by the per-token tables [L, hd/2]: adjacent real channels (2j, 2j + 1)
    form complex channel j. In float32, cast back to x's dtype."""
    pairs = x.astype(F32).reshape(*x.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.stack([re * c - im * s, re * s + im * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
