"""What the Mosaic GPU grouped GEMMs share: tile geometry, the work table of a persistent grid,
and the row-masked stores.

Tiles (``work_table``): a TMA copy into 8-row shared-memory tiles must start on a multiple of 8
rows, so an expert's tiles load ROWS rows from its first row rounded down to 8, then every ROWS; a
tile multiplies all of them and stores only its expert's rows (up to 7 rows of another expert ride
along at the front). The store: TMA copies of static sizes, one per set bit of the row count (at
most 8; a full tile is one copy), from an untiled staging buffer. Rows past ``sum(group_sizes)``
(a virtual expert) come out as zeros, as in ``lax.ragged_dot``; x tiles reading past the last row
get TMA's zero fill.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels.moe.group_tiles import group_bounds, tile_programs

ROWS, DEPTH = 128, 64  # a tile's rows, k per step
MEMORY_REGISTERS = 40  # the producer warpgroup's registers (it only issues copies)
ALIGN = 8  # rows per shared-memory tile: where a TMA copy of x may start
TILES = (plgpu.TilingTransform((ALIGN, DEPTH)), plgpu.SwizzleTransform(128))  # 128-byte bf16 rows


def work_table(group_sizes: jax.Array, num_rows: int, num_col_blocks: int,
               tail_rows: int = 0) -> jax.Array:
    """int32 [P, 5], one row per (row tile, column block): (load start, first row, end row,
    expert, column block). Expert e's rows [s, t) take ROWS-row tiles loading from
    ``a = 8 floor(s / 8) + ROWS j`` and storing ``[max(s, a), min(t, a + ROWS))``; with
    ``tail_rows``, a remainder of at most that many rows past the last full tile joins it (one tile
    of up to ROWS + tail_rows rows: 146 rows run as one tile, not two). Rows past sum(group_sizes)
    form expert E (stored as zeros). Sized for the worst case (each expert adds at most one tile
    and 7 rows); the rest are idle (first row == end row). Groups and program order as
    the Triton kernels' (``group_tiles``)."""
    n_groups = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, num_rows)
    ends, first = starts + sizes, starts // ALIGN * ALIGN
    tiles = (ends - first + ROWS - 1) // ROWS
    merged = (tiles >= 2) & (ends - first - (tiles - 1) * ROWS <= tail_rows)
    tiles = jnp.where(sizes > 0, tiles - merged, 0)
    n_programs = (pl.cdiv(num_rows + ALIGN * (n_groups + 1), ROWS) + n_groups + 1) * num_col_blocks
    group, local, block, valid = tile_programs(tiles, num_col_blocks, n_programs)
    load = first[group] + local * ROWS
    last = local == tiles[group] - 1  # the last tile stores the rest (its tail, if merged)
    row_start = jnp.where(valid, jnp.maximum(starts[group], load), 0)
    row_end = jnp.where(valid, jnp.where(last, ends[group], load + ROWS), 0)
    return jnp.stack([jnp.where(valid, load, 0), row_start, row_end, group,
                      jnp.where(valid, block, 0)], axis=1).astype(jnp.int32)


def program_row(meta_ref, p):
    """Row p of the work table (``work_table``): load start, first row, end row, expert, column
    block."""
    return tuple(meta_ref[p, i] for i in range(5))


def run_program(count, real, w, products, zeros) -> None:
    """A program's work: ``products()`` (all warpgroups) for rows of a real expert, ``zeros()``
    (the compute warpgroups only) for rows past sum(group_sizes); nothing for an idle program."""
    pl.when((count > 0) & real)(products)
    pl.when((count > 0) & ~real & (w < 2))(zeros)


def rows_in_window(row_start, row_end, window_start, window_rows):
    """The program's rows [row_start, row_end) that fall in [window_start, window_start +
    window_rows), as (first row, count): a staged window holds rows of neighbouring programs too."""
    first = jnp.maximum(row_start, window_start)
    return first, jnp.maximum(jnp.minimum(row_end, window_start + window_rows) - first, 0)


def store_rows(staged, out, offset, start, count):
    """``staged[offset:offset + count]`` to ``out[start:start + count]`` (traced, offset + count <=
    the staged rows) as one TMA copy per set bit of count: copies need static sizes, and other rows
    belong to other tiles."""
    done = 0  # rows stored so far
    size = staged.shape[0]
    while size:
        @pl.when((count & size) != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(staged.at[pl.ds(offset + done, size)],
                                    out.at[pl.ds(start + done, size)])

        done = done + (count & size)
        size //= 2


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA))
def store_transposed_wgmma(ctx, staging, h_t):
    """staging[t, n] = h_t[n, t] for a [64, T] array in wgmma's layout into a [T, 64] buffer: one
    2-byte store per element (Mosaic's stores want the array's vectors along the memory's unit
    stride; this runs once per tile, against its k steps of products)."""
    del ctx
    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    c = lambda v: utils.c(v, i32)  # noqa: E731
    base = utils.memref_ptr(staging)  # [T, 64] bf16, rows contiguous
    width = h_t.shape[0]
    tid = utils.thread_idx()
    lane = arith.remui(tid, c(32))
    warp = arith.remui(arith.divui(tid, c(32)), c(4))
    n0 = arith.addi(arith.muli(warp, c(16)), arith.divui(lane, c(4)))  # h_t's row: a column here
    t0 = arith.muli(arith.remui(lane, c(4)), c(2))  # h_t's first column: a row here
    for col in range(h_t.shape[1] // 8):
        for half in range(2):
            pair = h_t.registers[0, col, 0, 0, half, 0, 0, 0, 0]
            for e in range(2):
                t = arith.addi(t0, c(8 * col + e))
                flat = arith.addi(arith.muli(t, c(width)), arith.addi(n0, c(8 * half)))
                value = utils.bitcast(vector.extract(pair, [], [e]), i16)
                llvm.store(value, utils.getelementptr(base, [flat], i16))


def sm_count() -> int:
    """Streaming multiprocessors of the GPU the kernel is traced for: one persistent CTA each, so a
    GPU with fewer SMs than an H200's 132 (an H100 PCIe's 114) does not run a second wave. The
    abstract mesh's device where one is set (lowering without a GPU), else the first device's;
    132 when that is no GPU (the interpreter)."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.num_cores
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else 132
