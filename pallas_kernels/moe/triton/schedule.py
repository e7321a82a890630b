"""The Triton grouped GEMMs' work table: one row per program, (row start, row end, expert, column block).

Every expert's rows are cut into row tiles that never straddle two experts (at most cdiv(M, bm) + E
tiles); each (row tile, column block) pair is one program, numbered as `group_tiles.tile_programs`
does. With a tile config's `tail_m`, an expert's last tile, when it holds at most tail_m rows, runs at
that height; with `merge_tail` a program may cover block_m + tail_m rows, and each expert is cut the
cheaper way (`row_tiling`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.moe.group_tiles import group_bounds, tile_programs
from pallas_kernels.moe.triton.tiles import TileConfig


def mma_height(count: jax.Array, block_m: int, tail: int) -> jax.Array:
    """MMA rows a program with `count` rows runs (the kernel's `run` picks the same): tail, block_m, or
    block_m + tail (merged)."""
    return jnp.where(count <= tail, tail, jnp.where(count <= block_m, block_m, block_m + tail))


def row_tiling(sizes: jax.Array, block_m: int, tail: int) -> tuple[jax.Array, jax.Array]:
    """(tiles, stride) per group for merged tails: the cheaper in MMA rows of two cuts, a tie going to (a).

    (a) block_m-row tiles, a remainder of at most `tail` rows joining the last of them;
    (b) tiles of block_m + tail rows (two MMAs each).
    A tile's cost is the height its program runs (`mma_height`). At 146 rows, block_m 128, tail 32 both
    give one 160-row tile; at 585 rows (b) gives 3 x 160 + 128 against 5 x 128; at 256 rows (a) gives
    2 x 128.
    """
    full = (sizes + block_m - 1) // block_m
    last = sizes - (full - 1) * block_m  # rows of the last block_m tile
    merge = (full >= 2) & (last <= tail)
    tiles_a = full - merge
    cost_a = jnp.where(merge, (full - 1) * block_m + tail, (full - 1) * block_m + mma_height(last, block_m, tail))
    stride_b = block_m + tail
    tiles_b = (sizes + stride_b - 1) // stride_b
    cost_b = (tiles_b - 1) * stride_b + mma_height(sizes - (tiles_b - 1) * stride_b, block_m, tail)
    use_b = cost_b < cost_a
    return jnp.where(use_b, tiles_b, tiles_a), jnp.where(use_b, stride_b, block_m)


def merged_tail_rows(cfg: TileConfig) -> int:
    """Rows a program may take past block_m (a merged tail), 0 without merging."""
    return cfg.tail_m if cfg.merge_tail else 0


def schedule(group_sizes: jax.Array, num_rows: int, block_m: int, num_n_blocks: int,
             merge_rows: int = 0) -> jax.Array:
    """int32 [P, 4] table, one row per program: (row_start, row_end, expert, n_block).

    Each expert's rows are cut into block_m-row tiles, or with merge_rows > 0 as `row_tiling` picks; an
    expert's last tile takes the rest. Rows past sum(group_sizes) form a virtual expert E whose tiles store
    zeros. The table is sized for the worst case, P = (cdiv(M, bm) + E) * n_blocks (merged cuts have no more
    tiles); programs past the real tiles get row_start == row_end (idle). Written as closed-form broadcasts
    over [P] x [E+1] (no sort, scatter or search loop), so XLA fuses it into a couple of tiny kernels.
    """
    num_groups = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, num_rows)
    if merge_rows:
        tiles, stride = row_tiling(sizes, block_m, merge_rows)
    else:
        tiles, stride = (sizes + block_m - 1) // block_m, jnp.full_like(sizes, block_m)
    num_programs = (pl.cdiv(num_rows, block_m) + num_groups) * num_n_blocks
    grp, local, n_block, valid = tile_programs(tiles, num_n_blocks, num_programs)
    row_start = starts[grp] + local * stride[grp]
    group_end = starts[grp] + sizes[grp]
    per = jnp.maximum(tiles[grp], 1)
    row_end = jnp.where(local == per - 1, group_end, row_start + stride[grp])  # the last tile takes the rest
    row_start = jnp.where(valid, row_start, 0)
    row_end = jnp.where(valid, row_end, 0)
    return jnp.stack([row_start, row_end, grp, jnp.where(valid, n_block, 0)], axis=1).astype(jnp.int32)


def mma_rows(group_sizes: jax.Array, num_rows: int, cfg: TileConfig) -> jax.Array:
    """Rows of MMA work the kernel runs per column block (each tile at its height), rows past the groups
    excluded: the useful rows are sum(group_sizes), the rest is padding of partial tiles."""
    table = schedule(group_sizes, max(num_rows, cfg.block_m), cfg.block_m, 1, merged_tail_rows(cfg))
    count = table[:, 1] - table[:, 0]
    height = mma_height(count, cfg.block_m, cfg.tail_m or 0)
    return jnp.sum(jnp.where((count > 0) & (table[:, 2] < group_sizes.shape[0]), height, 0))
