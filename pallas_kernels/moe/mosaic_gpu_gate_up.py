"""The routed experts' gate+up grouped GEMM with the SiTU epilogue in Mosaic GPU (Hopper: TMA copies,
wgmma, a producer warpgroup, persistent CTAs).

Same result as ``pallas_grouped_gemm.grouped_gate_up_situ`` on bf16 weights, over the same order of
work (expert by expert, column block major, row tiles fastest, so co-resident tiles share a weight
block in L2). Why a second kernel: the Pallas-Triton one runs level with ``torch._grouped_mm`` at 28
experts (520-545 TFLOP/s on the H200) with one 192 KB CTA per SM and no producer, so each tile's
epilogue (SiTU, store) stalls the tensor cores and every load is issued by the warps that also run
the MMAs. Here one CTA per SM walks the table (``plgpu.nd_loop``); a third warpgroup issues the TMA
copies of the x tile and both weight tiles ``STAGES`` k steps ahead
(``plgpu.emit_pipeline_warp_specialized``), so the next tile's loads start while this one's epilogue
runs; the two compute warpgroups each hold a [128, 64] gate and up accumulator (64 of the column
block's 128 columns), take SiTU in fp32 and store their rows by TMA.

Tiles (``_work_table``): a TMA copy into 8-row shared-memory tiles must start on a multiple of 8
rows, so an expert's tiles load 128 rows from its first row rounded down to 8, then every 128; a
tile multiplies all 128 and stores only its expert's rows (up to 7 rows of another expert ride
along at the front). The store: TMA copies of static sizes, one per set bit of the row count (at
most 8; a full tile is one copy), from an untiled staging buffer. Rows past ``sum(group_sizes)``
(a virtual expert) come out as zeros, as in ``lax.ragged_dot``; x tiles reading past the last row
get TMA's zero fill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.pallas_grouped_gemm import situ_f32, group_bounds, tile_programs

_F32, _BF16 = jnp.float32, jnp.bfloat16
ROWS, COLS, DEPTH = 128, 128, 64  # a tile's rows, its weight rows (per gate / up), k per step
HALF = COLS // 2  # each compute warpgroup's columns
STAGES = 4  # k steps in flight: 4 x 48 KB of tiles + 32 KB of output staging fill the shared memory
MEMORY_REGISTERS = 40  # the producer warpgroup's registers (it only issues copies)
ALIGN = 8  # rows per shared-memory tile: where a TMA copy of x may start
TILES = (plgpu.TilingTransform((ALIGN, DEPTH)), plgpu.SwizzleTransform(128))  # 128-byte bf16 rows


def _work_table(group_sizes: jax.Array, num_rows: int, num_col_blocks: int) -> jax.Array:
    """int32 [P, 5], one row per (row tile, column block): (load start, first row, end row,
    expert, column block). Expert e's rows [s, t) take tiles loading ROWS rows from
    ``a = 8 floor(s / 8) + ROWS j`` and storing ``[max(s, a), min(t, a + ROWS))``. Rows past
    sum(group_sizes) form expert E (stored as zeros). Sized for the worst case (each expert adds at
    most one tile and 7 rows); the rest are idle (first row == end row). Groups and program order
    as ``pallas_grouped_gemm._schedule``'s (``group_bounds``, ``tile_programs``)."""
    n_groups = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, num_rows)
    ends, first = starts + sizes, starts // ALIGN * ALIGN
    tiles = jnp.where(sizes > 0, (ends - first + ROWS - 1) // ROWS, 0)
    n_programs = (pl.cdiv(num_rows + ALIGN * (n_groups + 1), ROWS) + n_groups + 1) * num_col_blocks
    group, local, block, valid = tile_programs(tiles, num_col_blocks, n_programs)
    load = first[group] + local * ROWS
    row_start = jnp.where(valid, jnp.maximum(starts[group], load), 0)
    row_end = jnp.where(valid, jnp.minimum(ends[group], load + ROWS), 0)
    return jnp.stack([jnp.where(valid, load, 0), row_start, row_end, group,
                      jnp.where(valid, block, 0)], axis=1).astype(jnp.int32)


def _store_rows(staged, out, offset, start, count):
    """``staged[offset:offset + count]`` to ``out[start:start + count]`` (traced, offset + count <=
    ROWS) as one TMA copy per set bit of count: copies need static sizes, and other rows belong to
    other tiles."""
    done = 0  # rows stored so far
    size = ROWS
    while size:
        @pl.when((count & size) != 0)
        def _(size=size, done=done):
            plgpu.copy_smem_to_gmem(staged.at[pl.ds(offset + done, size)],
                                    out.at[pl.ds(start + done, size)])

        done = done + (count & size)
        size //= 2


def _body(meta_ref, x_ref, w1_ref, w3_ref, o_ref, *, n_programs: int, n_groups: int, beta: float,
          linear_beta: float | None, stages: int):
    k_steps = x_ref.shape[1] // DEPTH

    def pipeline(step, context):
        tile = lambda rows: plgpu.BlockSpec((rows, DEPTH), lambda k: (0, k), transforms=TILES,  # noqa: E731
                                            delay_release=1)
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=MEMORY_REGISTERS,
            in_specs=[tile(ROWS), tile(COLS), tile(COLS)], max_concurrent_steps=stages,
            wg_axis="wg", num_compute_wgs=2, compute_context=context)

    ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)
    allocations = pipeline(ignore, ignore).get_allocations(
        x_ref.at[pl.ds(0, ROWS)], w1_ref.at[0, pl.ds(0, COLS)], w3_ref.at[0, pl.ds(0, COLS)])

    def scope(buffers, staging):
        w = lax.axis_index("wg")

        @plgpu.nd_loop((n_programs,), collective_axes="sm")
        def _(info):
            (p,) = info.index
            load, row_start, row_end = meta_ref[p, 0], meta_ref[p, 1], meta_ref[p, 2]
            group, block = meta_ref[p, 3], meta_ref[p, 4]
            count = row_end - row_start
            real = group < n_groups  # the virtual expert past sum(group_sizes) stores zeros
            cols = pl.ds(pl.multiple_of(block * COLS, COLS), COLS)

            def stage_and_store(h):
                """A compute warpgroup's [ROWS, HALF] output tile, its own rows to HBM."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores
                staging[w] = h
                plgpu.commit_smem()
                mine = pl.multiple_of(block * COLS + w * HALF, HALF)
                _store_rows(staging.at[w], o_ref.at[:, pl.ds(mine, HALF)], row_start - load,
                            row_start, count)

            def context(run):
                def accumulate(acc_g, acc_u):
                    run((acc_g, acc_u))
                    # the exact ops: approx_math makes them the fast hardware forms
                    h = situ_f32(acc_g[...], acc_u[...], beta, linear_beta, approx=False)
                    stage_and_store(h.astype(o_ref.dtype))

                pl.run_scoped(accumulate, plgpu.ACC((ROWS, HALF), _F32),
                              plgpu.ACC((ROWS, HALF), _F32))

            def step(_, x_s, g_s, u_s, accs):
                mine = pl.ds(pl.multiple_of(w * HALF, HALF), HALF)
                plgpu.wgmma(accs[0], x_s, g_s.at[mine].transpose((1, 0)))
                plgpu.wgmma(accs[1], x_s, u_s.at[mine].transpose((1, 0)))
                plgpu.wgmma_wait(2)  # the last step's products are done: its slot is released
                return accs

            @pl.when((count > 0) & real)
            def _():
                pipeline(step, context)(x_ref.at[pl.ds(pl.multiple_of(load, ALIGN), ROWS)],
                                        w1_ref.at[group, cols], w3_ref.at[group, cols],
                                        allocations=buffers)

            @pl.when((count > 0) & ~real & (w < 2))  # the compute warpgroups, no products
            def _():
                stage_and_store(jnp.zeros((ROWS, HALF), o_ref.dtype))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, allocations, plgpu.SMEM((2, ROWS, HALF), o_ref.dtype),
                  collective_axes="wg")


def takes(x: jax.Array, w1) -> bool:
    """Whether the kernel takes these operands: bf16 x and dense bf16 weights [E, N, K] with K a
    multiple of 64 and N of 128."""
    return (isinstance(w1, jax.Array) and x.dtype == _BF16 and w1.dtype == _BF16 and w1.ndim == 3
            and x.shape[1] % DEPTH == 0 and w1.shape[1] % COLS == 0)


@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "num_sms", "stages",
                                             "interpret"))
def gate_up_situ_mgpu(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *,
                      beta: float = 4.0, linear_beta: float | None = 25.0, num_sms: int = 132,
                      stages: int = STAGES, interpret: bool = False) -> jax.Array:
    """SiTU(x @ w1_e^T, x @ w3_e^T) for rows grouped by expert: x [M, K] bf16 sorted by expert,
    w1, w3 [E, N, K] bf16, group_sizes [E] int32 -> [M, N] bf16. ``num_sms``: persistent CTAs (the
    H200's 132); ``stages``: k steps of tiles in flight. ``interpret``: Mosaic GPU's CPU
    interpreter (tests)."""
    if not takes(x, w1) or w3.shape != w1.shape or w3.dtype != w1.dtype:
        raise ValueError(f"gate_up_situ_mgpu: wants bf16 x [M, K] and w1, w3 [E, N, K] with K % "
                         f"{DEPTH} == 0 and N % {COLS} == 0, got x {x.dtype} {x.shape}, w1 "
                         f"{getattr(w1, 'dtype', type(w1))} {w1.shape}, w3 {w3.dtype} {w3.shape}")
    m0, n = x.shape[0], w1.shape[1]
    # x's TMA descriptor tiles it by 8 rows, and a tile's copy (ROWS rows) may be no taller than x;
    # the model's row counts (tokens x top-k) are multiples of 16, so this copy is for odd callers
    rows = max(ROWS, -(-m0 // ALIGN) * ALIGN)
    if rows != m0:
        x = jnp.pad(x, ((0, rows - m0), (0, 0)))
    m = x.shape[0]
    meta = _work_table(group_sizes, m, n // COLS)
    kernel = plgpu.kernel(
        functools.partial(_body, n_programs=meta.shape[0], n_groups=w1.shape[0], beta=beta,
                          linear_beta=linear_beta, stages=stages),
        out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="k3_moe_gate_up_situ_mgpu",
    )
    return kernel(meta, x, w1, w3)[:m0]
