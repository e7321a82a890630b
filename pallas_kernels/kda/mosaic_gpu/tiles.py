"""Tile layouts and register-array helpers shared by the KDA Mosaic GPU kernels
(``mosaic_gpu_pairs.py``, ``mosaic_gpu_inter.py``): one place for the swizzle-tile width and the
shared-memory transforms that TMA copies and wgmma operands must agree on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.chunk_math import C

HALF = C  # channels per bf16 128-byte swizzle tile (64), also the chunk's width
WG = plgpu.Layout.WGMMA
ROWS, COLS = WG.reduce(1), WG.reduce(0)  # per row / per column of a WGMMA array
# shared-memory tiles of a wgmma operand or a TMA copy: 128-byte rows, swizzled
F32_TILES = (plgpu.TilingTransform((8, HALF // 2)), plgpu.SwizzleTransform(128))


def bf16_tiles(cols: int = HALF) -> tuple:
    """Tiles of a bf16 array ``cols`` wide (32 or 64): rows of ``2 cols`` bytes, swizzled at that
    width, so a [*, 32] wgmma operand needs no padding to 64 columns."""
    return plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols)


BF16_TILES = bf16_tiles()


def rows(v: jax.Array, width: int = HALF) -> jax.Array:
    """A per-row vector [M] broadcast over [M, width] in the WGMMA layout."""
    return plgpu.layout_cast(lax.broadcast_in_dim(v, (v.shape[0], width), [0]), WG)


def sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))
