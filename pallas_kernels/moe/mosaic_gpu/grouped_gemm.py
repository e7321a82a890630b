"""The routed experts' grouped GEMMs in Mosaic GPU (Hopper: TMA copies, wgmma, a producer warpgroup,
persistent CTAs): gate+up with the SiTU epilogue (``gate_up_situ_mgpu``), and a plain product
(``grouped_matmul_mgpu``) for the down projection and for the backward's products with the forward's
weights (fp32 out, weights read [E, K, N] as stored).

Same results as the Triton ``grouped_gate_up_situ`` / ``grouped_matmul`` on bf16 weights, over the
same order of work (expert by expert, column block major, row tiles fastest, so co-resident tiles
share a weight block in L2). Why second kernels: the Triton ones run one CTA per SM with no producer,
so each tile's epilogue (SiTU, store) stalls the tensor cores and every load is issued by the warps
that also run the MMAs. Here one CTA per SM walks the table (``plgpu.nd_loop``); a third warpgroup
issues the TMA copies of the x tile and the weight tiles ``STAGES`` k steps ahead
(``plgpu.emit_pipeline_warp_specialized``), so the next tile's loads start while this one's epilogue
runs. The two compute warpgroups split the tile's 128 rows: each runs 64-row wgmmas against every
column of the weight tiles (gate+up: [64, 128] gate and up accumulators; down: one [64, 256]), which
reads each weight tile from shared memory once per warpgroup rather than once per 64 rows, then
finishes in fp32 (SiTU, or nothing) and stores its rows by TMA. (Splitting the columns instead, two
[128, 64] accumulators each, ran level.) Work table and stores: ``work.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.epilogue import situ_f32
from pallas_kernels.moe.mosaic_gpu.work import (
    ALIGN, DEPTH, MEMORY_REGISTERS, ROWS, TILES, program_row, rows_in_window, run_program, sm_count,
    store_rows, store_transposed_wgmma, work_table,
)

_F32, _BF16 = jnp.float32, jnp.bfloat16
WG_ROWS = ROWS // 2  # each compute warpgroup's rows of the tile (wgmma's 64-row M)
GATE_UP_COLS = 128  # a tile's columns (weight rows) of gate+up: 128 of the gate, 128 of the up
PLAIN_COLS = 256  # a tile's columns of a plain product (the down projection)
TAIL_ROWS = 32  # extra rows of a tile with a tail: N of a swapped product
TAIL_STORE_COLS = 64  # columns per staged store with a tail (the staging half as wide)
STAGED_ROW_BYTES = 256  # bytes of an output row per staged store: 128 bf16 or 64 fp32 columns
STAGES = 4  # k steps in flight: 4 x 48 KB of tiles + 32 KB of output staging fill the shared memory
# (with a tail: 4 x 52 KB + 16 KB)


def store_transposed(staging, h_t, interpret: bool = False) -> None:
    """staging[...] = h_t.T for a [64, T] result of a swapped product (weight rows by token rows);
    the interpreter (which runs no PTX-level code) takes the transpose as it is."""
    if interpret:
        staging[...] = h_t.T
    else:
        store_transposed_wgmma(staging, h_t)


def _body(meta_ref, x_ref, *refs, n_programs: int, n_groups: int, block_cols: int, stages: int,
          finish, kn: bool, tail_rows: int, interpret: bool):
    """One persistent CTA: the table's programs, each a [ROWS, block_cols] output tile from one
    [block_cols, K] block of every weight (gate and up, or the one plain weight; [K, block_cols]
    blocks of weights stored [E, K, N], ``kn``). With ``tail_rows`` (bf16 out, weights [E, N, K])
    every tile loads ROWS + tail_rows rows of x, and a merged last tile multiplies the extra rows
    too, as a swapped product: weight rows by token rows, each warpgroup its half of the columns."""
    *w_refs, o_ref = refs
    k_steps = x_ref.shape[1] // DEPTH
    tile_rows = ROWS + tail_rows
    store_cols = min(block_cols, STAGED_ROW_BYTES // jnp.dtype(o_ref.dtype).itemsize)
    tail_cols = block_cols // 2  # each compute warpgroup's columns of the tail rows (wgmma's M)
    if tail_rows:  # half-width staging leaves the shared memory for the taller x tiles
        store_cols = TAIL_STORE_COLS

    def weight_block(w_ref, group, cols):
        """Expert ``group``'s weight rows ``cols`` (its columns, kn), all of K."""
        return w_ref.at[group, :, cols] if kn else w_ref.at[group, cols]

    def pipeline(step, context):
        spec = lambda shape, index: plgpu.BlockSpec(shape, index, transforms=TILES,  # noqa: E731
                                                    delay_release=1)
        w_spec = (spec((DEPTH, block_cols), lambda k: (k, 0)) if kn
                  else spec((block_cols, DEPTH), lambda k: (0, k)))
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=MEMORY_REGISTERS,
            in_specs=[spec((tile_rows, DEPTH), lambda k: (0, k))] + [w_spec] * len(w_refs),
            max_concurrent_steps=stages, wg_axis="wg", num_compute_wgs=2, compute_context=context)

    ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)
    allocations = pipeline(ignore, ignore).get_allocations(
        x_ref.at[pl.ds(0, tile_rows)],
        *(weight_block(w_ref, 0, pl.ds(0, block_cols)) for w_ref in w_refs))

    def scope(buffers, staging):
        w = lax.axis_index("wg")

        @plgpu.nd_loop((n_programs,), collective_axes="sm")
        def _(info):
            (p,) = info.index
            load, row_start, row_end, group, block = program_row(meta_ref, p)
            count = row_end - row_start
            real = group < n_groups  # the virtual expert past sum(group_sizes) stores zeros
            cols = pl.ds(pl.multiple_of(block * block_cols, block_cols), block_cols)
            wg_load = load + w * WG_ROWS  # this warpgroup's rows: [wg_load, wg_load + WG_ROWS)
            first, wg_count = rows_in_window(row_start, row_end, wg_load, WG_ROWS)

            def stage_and_store(h):
                """A compute warpgroup's output tile, its own rows to HBM, store_cols at a time."""
                for c in range(block_cols // store_cols):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging buffer is free
                    staging[w] = h[:, c * store_cols:(c + 1) * store_cols]
                    plgpu.commit_smem()
                    col0 = pl.multiple_of(block * block_cols + c * store_cols, store_cols)
                    store_rows(staging.at[w], o_ref.at[:, pl.ds(col0, store_cols)],
                                first - wg_load, first, wg_count)

            def stage_and_store_tail(h_t):
                """A compute warpgroup's [tail_cols, tail_rows] swapped result: the tail rows
                (from load + ROWS) of its half of the columns, TAIL_STORE_COLS at a time."""
                tail_start = load + ROWS  # row_start < tail_start: a tile's first row is < load + 8
                buffer = staging.at[w, pl.ds(0, tail_rows)]
                for c in range(tail_cols // TAIL_STORE_COLS):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    store_transposed(buffer, h_t[c * TAIL_STORE_COLS:(c + 1) * TAIL_STORE_COLS],
                                     interpret)
                    plgpu.commit_smem()
                    col0 = pl.multiple_of(block * block_cols + w * tail_cols + c * TAIL_STORE_COLS,
                                          TAIL_STORE_COLS)
                    store_rows(buffer, o_ref.at[:, pl.ds(col0, TAIL_STORE_COLS)], 0, tail_start,
                                jnp.maximum(row_end - tail_start, 0))

            def context_for(with_tail: bool):
                """The accumulators a program runs (with its tail's, ``with_tail``) and its
                epilogue."""
                def context(run):
                    def accumulate(*accs):
                        run(accs)
                        main, tail = accs[:len(w_refs)], accs[len(w_refs):]
                        stage_and_store(finish(*(acc[...] for acc in main)).astype(o_ref.dtype))
                        if tail:
                            stage_and_store_tail(finish(*(acc[...] for acc in tail)).astype(o_ref.dtype))

                    tail_accs = [plgpu.ACC((tail_cols, tail_rows), _F32) for _ in w_refs if with_tail]
                    pl.run_scoped(accumulate, *(plgpu.ACC((WG_ROWS, block_cols), _F32) for _ in w_refs),
                                  *tail_accs)
                return context

            def step(_, x_s, *rest):
                *w_s, accs = rest
                mine = x_s.at[pl.ds(pl.multiple_of(w * WG_ROWS, WG_ROWS), WG_ROWS)]
                for acc, tile in zip(accs, w_s):  # a [K, N] operand: kn tiles as loaded
                    plgpu.wgmma(acc, mine, tile if kn else tile.transpose((1, 0)))
                if len(accs) > len(w_s):  # my half of the weight rows by the tail's token rows
                    tail = x_s.at[pl.ds(ROWS, tail_rows)].transpose((1, 0))
                    my_cols = pl.ds(pl.multiple_of(w * tail_cols, tail_cols), tail_cols)
                    for acc, tile in zip(accs[len(w_s):], w_s):
                        plgpu.wgmma(acc, tile.at[my_cols], tail)
                plgpu.wgmma_wait(len(accs))  # the last step's products are done: its slot is released
                return accs

            def products(with_tail: bool):
                return lambda: pipeline(step, context_for(with_tail))(
                    x_ref.at[pl.ds(pl.multiple_of(load, ALIGN), tile_rows)],
                    *(weight_block(w_ref, group, cols) for w_ref in w_refs), allocations=buffers)

            has_tail = row_end > load + ROWS  # only a merged last tile (``work_table``)

            def tail_zeros():  # a splat: given the transposed store's layout
                zeros = jnp.zeros((tail_cols, tail_rows), o_ref.dtype)
                stage_and_store_tail(zeros if interpret
                                     else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA))

            def store_zeros():
                stage_and_store(jnp.zeros((WG_ROWS, block_cols), o_ref.dtype))
                if tail_rows:
                    pl.when(has_tail)(tail_zeros)

            def either_products():  # two pipelines over the same buffers: tail wgmmas or none
                pl.when(has_tail)(products(True))
                pl.when(~has_tail)(products(False))

            run_program(count, real, w, either_products if tail_rows else products(False),
                         store_zeros)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, allocations, plgpu.SMEM((2, WG_ROWS, store_cols), o_ref.dtype),
                  collective_axes="wg")


def fits(k: int, n: int, block_cols: int) -> bool:
    """Whether a product with contraction k and output width n tiles this kernel: k a multiple of
    DEPTH, n of the column block (GATE_UP_COLS for gate+up, PLAIN_COLS for a plain product)."""
    return k % DEPTH == 0 and n % block_cols == 0


def _takes(x: jax.Array, w, block_cols: int, kn: bool) -> bool:
    """bf16 x [M, K] and dense bf16 weights [E, N, K] ([E, K, N] with ``kn``) that `fits`."""
    if not (isinstance(w, jax.Array) and x.dtype == _BF16 and w.dtype == _BF16 and w.ndim == 3):
        return False
    k, n = (w.shape[1], w.shape[2]) if kn else (w.shape[2], w.shape[1])
    return x.ndim == 2 and x.shape[1] == k and fits(k, n, block_cols)


def _grouped(x: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array, *, finish,
             block_cols: int, out_dtype, kn: bool, name: str, num_sms: int | None, stages: int,
             interpret: bool, tail_rows: int = 0) -> jax.Array:
    """finish(x @ w_e^T for w in weights) per expert's rows (x @ w_e for ``kn`` weights), as one
    persistent kernel."""
    w0 = weights[0]
    if not _takes(x, w0, block_cols, kn) or any(w.shape != w0.shape or w.dtype != w0.dtype
                                               for w in weights):
        layout = "[E, K, N]" if kn else "[E, N, K]"
        raise ValueError(f"{name}: wants bf16 x [M, K] and bf16 weights {layout} of one shape with K % "
                         f"{DEPTH} == 0 and N % {block_cols} == 0, got x {x.dtype} {x.shape}, weights "
                         + ", ".join(f"{getattr(w, 'dtype', type(w).__name__)} {getattr(w, 'shape', '')}"
                                     for w in weights))
    m0, n = x.shape[0], w0.shape[2] if kn else w0.shape[1]
    # x's TMA descriptor tiles it by 8 rows, and a tile's copy (ROWS rows) may be no taller than x;
    # the model's row counts (tokens x top-k) are multiples of 16, so this copy is for odd callers
    rows = max(ROWS + tail_rows, -(-m0 // ALIGN) * ALIGN)
    if rows != m0:
        x = jnp.pad(x, ((0, rows - m0), (0, 0)))
    meta = work_table(group_sizes, rows, n // block_cols, tail_rows)
    kernel = plgpu.kernel(
        functools.partial(_body, n_programs=meta.shape[0], n_groups=w0.shape[0],
                          block_cols=block_cols, stages=stages, finish=finish, kn=kn,
                          tail_rows=tail_rows, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
        grid=(num_sms or sm_count(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name=f"k3_moe_{name}",
    )
    return kernel(meta, x, *weights)[:m0]


def _check_tail(name: str, tail_rows: int) -> None:
    if tail_rows not in (0, TAIL_ROWS):
        raise ValueError(f"{name}: tail_rows={tail_rows}, expected 0 or {TAIL_ROWS}")


@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "num_sms", "stages",
                                             "tail_rows", "interpret"))
def gate_up_situ_mgpu(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *,
                      beta: float = 4.0, linear_beta: float | None = 25.0, num_sms: int | None = None,
                      stages: int = STAGES, tail_rows: int = 0, interpret: bool = False) -> jax.Array:
    """SiTU(x @ w1_e^T, x @ w3_e^T) for rows grouped by expert: x [M, K] bf16 sorted by expert,
    w1, w3 [E, N, K] bf16, group_sizes [E] int32 -> [M, N] bf16. ``num_sms``: persistent CTAs
    (None: ``sm_count()``, one per SM); ``stages``: k steps of tiles in flight. ``tail_rows``: 0, or
    TAIL_ROWS to merge an expert's remainder of up to that many rows into its last tile (small
    groups, e.g. ~146 rows per expert at 112 experts, where a second 128-row tile would be mostly
    padding).
    ``interpret``: Mosaic GPU's CPU interpreter (tests)."""
    _check_tail("gate_up_situ_mgpu", tail_rows)
    # the exact ops: approx_math makes them the fast hardware forms
    situ = lambda g, u: situ_f32(g, u, beta, linear_beta)  # noqa: E731
    return _grouped(x, (w1, w3), group_sizes, finish=situ, block_cols=GATE_UP_COLS,
                    out_dtype=x.dtype, kn=False, name="gate_up_situ_mgpu", num_sms=num_sms,
                    stages=stages, interpret=interpret, tail_rows=tail_rows)


@functools.partial(jax.jit, static_argnames=("out_dtype", "weights_kn", "num_sms", "stages",
                                             "tail_rows", "interpret"))
def grouped_matmul_mgpu(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
                        weights_kn: bool = False, num_sms: int | None = None, stages: int = STAGES,
                        tail_rows: int = 0, interpret: bool = False) -> jax.Array:
    """x @ w_e^T for rows grouped by expert (the experts' down projection, and the backward's
    products): x [M, K] bf16 sorted by expert, w [E, N, K] bf16 with N % 256 == 0, group_sizes [E]
    int32 -> [M, N] in ``out_dtype`` (x's by default; fp32 keeps the accumulator). ``weights_kn``:
    w is [E, K, N] and the result x @ w_e, as the backward multiplies by the forward's weights
    without a transposed copy. ``tail_rows``: as ``gate_up_situ_mgpu``'s (bf16 out, weights
    [E, N, K] only). Rows past sum(group_sizes) are zeros, as in ``lax.ragged_dot``."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    _check_tail("grouped_matmul_mgpu", tail_rows)
    if tail_rows and (weights_kn or out_dtype != _BF16):
        raise ValueError(f"grouped_matmul_mgpu: tail_rows={tail_rows} wants bf16 out and weights "
                         f"[E, N, K], got out_dtype {out_dtype}, weights_kn={weights_kn}")
    return _grouped(x, (w,), group_sizes, finish=lambda acc: acc, block_cols=PLAIN_COLS,
                    out_dtype=out_dtype, kn=weights_kn, name="grouped_matmul_mgpu",
                    num_sms=num_sms, stages=stages, interpret=interpret, tail_rows=tail_rows)
