"""Gate+up with the SiTU epilogue on MXFP4 expert weights, decoded in registers, in Mosaic GPU.

Why this kernel: wgmma reads its right operand from shared memory but its left one may come from
registers. So the packed weights are made the left operand ("swap AB": the tile computes
(x W^T)^T = W x^T, weight rows by token rows), and each compute warpgroup decodes its [64, 64]
operands of E2M1 codes straight into the bf16 registers wgmma reads: the weights cross HBM and
shared memory at 4.25 bits each (the release's bytes, no copy) and are never written back in bf16.
Reading 4.25 bits a weight instead of 16 brings it close to the bf16 kernel on bf16 weights, well
ahead of decoding the layer in XLA first (benchmarks/RESULTS.md). Every decode instruction costs
tensor-core time (``benchmarks/mxfp4_decode_cost.py`` measures it with a zero operand in place of
the decode). Feeding each decoded operand to 256 token rows instead of 128 halves the decode per
product but ran slower: a 256-row x tile leaves room for 64-column k steps only, twice as many steps
per product.

Work, tiles and stores as ``grouped_gemm`` (``work.py``'s work table and row stores): one
persistent CTA per SM, a producer warpgroup issuing TMA copies ``STAGES`` steps of ``STEP_K``
ahead, two compute warpgroups. A tile is 128 token rows by 128 gate and 128 up columns; warpgroup w
owns columns [64 w, 64 w + 64) of both, i.e. two [64, 128] fp32 accumulators (weight rows x token
rows). A step decodes and multiplies four [64, 64] operands in turn, so each decode runs while the
previous product does; all products finish within the step (left running across the loop's back
edge, as the bf16 kernel does, the register operands came out as NaN), so a step's
slot is free for the next copy as soon as the step returns: a stage more in flight than with the
bf16 kernel's one-step release delay. The epilogue scales the accumulators back (``FOLD``),
applies SiTU and stores the transposed result in two [64, 64] parts, so that the output staging
(16 KB) leaves the shared memory room for four stages of 50 KB.

The decode (``_decoder``, PTX in ``inline_mgpu``): wgmma's 8-bit operand layout gives each thread 4
consecutive bytes, i.e. 8 consecutive codes, of a row in one 32-bit register; the code's bits are
moved into a bf16's sign, exponent and mantissa fields (E2M1 is bf16 with a 2-bit exponent:
``s e1 e0 m`` -> bits 15, 8..7, 6 give ``value * 2^-126``, the subnormal code 0.5 included) and
multiplied by the block's scale times 2^(126 - FOLD). Two codes per instruction: 17 integer and
bf16x2 instructions per 8 codes (``_pair_ptx``), four of them integer multiplies that would
otherwise be shifts and masks on the logic unit, the busier one. Which register slot of wgmma's
operand layout a code lands in fixes an order of each 64 columns (``x_column_order``); x's columns
are permuted the same way by the caller, which leaves the sum over K unchanged and can ride the
gather that sorts rows by expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_kernels.moe.epilogue import situ_f32
from pallas_kernels.moe.mosaic_gpu.work import (
    ALIGN, DEPTH, MEMORY_REGISTERS, ROWS, TILES, program_row, rows_in_window, run_program, sm_count,
    store_rows, store_transposed_wgmma, work_table,
)
from pallas_kernels.mxfp4 import BLOCK

_F32, _BF16 = jnp.float32, jnp.bfloat16
COLS = 128  # a tile's weight rows, of the gate and of the up projection each
WG_COLS = COLS // 2  # each compute warpgroup's weight rows (wgmma's 64-row M)
STAGES = 4  # k steps in flight: 4 x 50 KB of tiles + 16 KB of output staging
STORE_ROWS = 64  # token rows staged per store: a half tile, which leaves room for the fourth stage
FOLD = 32  # the decoded weights are w * 2^-FOLD, the accumulators are scaled back by 2^FOLD
SCALE_MIN, SCALE_MAX = FOLD - 5, FOLD + 128  # scale bytes decoded exactly; others are clamped
STEP_K = 2 * DEPTH  # k per pipeline step: four decode+wgmma pairs, so that decodes overlap products
STEP_BYTES = STEP_K // 2  # a code row's bytes per step
OPERAND_BYTES = DEPTH // 2  # a code row's bytes per wgmma operand (64 columns)
# codes in 32-byte tiles, so that each operand's bytes are loaded on their own (``_body``'s step)
CODE_TILES = (plgpu.TilingTransform((ALIGN, OPERAND_BYTES)), plgpu.SwizzleTransform(OPERAND_BYTES))
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector, one value per row of the wgmma layout


def x_column_order(k: int) -> np.ndarray:
    """Column permutation p of K (x_ordered = x[:, p]) matching the decode's register order: in each
    64-column k step, wgmma column 32 c + 8 j + 2 t + e holds weight column 32 c + 8 t + j + 4 e
    (thread t of a row's four holds codes 8 t .. 8 t + 7 of each 32-column half; pair j of them is
    codes j and j + 4)."""
    if k % STEP_K:
        raise ValueError(f"x_column_order: K={k} must be a multiple of {STEP_K}")
    c, j, t, e = np.meshgrid(np.arange(2), np.arange(4), np.arange(4), np.arange(2), indexing="ij")
    step = (32 * c + 8 * t + j + 4 * e).reshape(-1)  # in wgmma column order (c, j, t, e)
    return (np.arange(0, k, DEPTH)[:, None] + step[None, :]).reshape(-1)


def scale_multipliers(scale: jax.Array) -> jax.Array:
    """E8M0 scale bytes [E, N, K/32] -> the bf16 factors the decode multiplies by, [E, K/32, N]
    (K-block major, so a k step's factors are one TMA box): 2^(s - 127) * 2^(126 - FOLD), the byte
    clamped to [SCALE_MIN, SCALE_MAX] where both the factor and the smallest decoded weight (a
    subnormal bf16) are exact; real scales (blocks with largest magnitude 2^-100 .. 2^33) lie
    inside."""
    s = jnp.clip(scale.astype(jnp.int32), SCALE_MIN, SCALE_MAX)
    bits = ((s + 126 - FOLD) << 7).astype(jnp.uint16)
    return jnp.swapaxes(lax.bitcast_convert_type(bits, _BF16), 1, 2)


def _pair_ptx() -> str:
    """PTX: one 32-bit register of 8 E2M1 codes ($4) and a bf16x2 factor ($5) -> four bf16x2
    registers, pair j = (code j, code j + 4): magnitude bits moved to 6..8 / 22..24, sign bits to
    15 / 31, times the factor. Pairs 0 and 1 (codes in bits 4 j .. 4 j + 3 of each half): the pair
    masked out, then one multiply by 2^a + 2^b places a copy of each code at both shifts (the
    copies do not overlap, so nothing carries), a mask keeps the magnitude of one and the sign of
    the other: four instructions. Pairs 2 and 3 need a right shift for the magnitude: five and four
    (pair 3's signs are in place)."""
    magnitude, sign, both = "0x01C001C0", "0x80008000", "0x81C081C0"
    lines = ["{", ".reg .b32 m, t;"]
    for j, factor in ((0, (1 << 6) + (1 << 12)), (1, (1 << 2) + (1 << 8))):
        lines += [f"and.b32 t, $4, {0x000F000F << 4 * j:#010x};", f"mul.lo.u32 t, t, {factor:#x};",
                  f"and.b32 t, t, {both};", f"mul.rn.bf16x2 ${j}, t, $5;"]
    lines += ["shr.b32 m, $4, 2;", f"and.b32 m, m, {magnitude};", "shl.b32 t, $4, 4;",
              f"lop3.b32 t, m, t, {sign}, 0xF8;", "mul.rn.bf16x2 $2, t, $5;"]  # m | (t & sign)
    lines += ["shr.b32 m, $4, 6;", f"and.b32 m, m, {magnitude};",
              f"lop3.b32 t, m, $4, {sign}, 0xF8;", "mul.rn.bf16x2 $3, t, $5;", "}"]
    return "\n".join(lines)


@functools.cache
def _decoder():
    """The decode of one wgmma operand: [64, OPERAND_BYTES] code bytes -> [64, 64] bf16."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_8BIT, _ROW, _ROW),
        return_type=plgpu.ShapeDtypeStruct((WG_COLS, DEPTH), _BF16, layout=plgpu.Layout.WGMMA),
    )
    def decode(ctx, codes, factor_lo, factor_hi):
        """[64, OPERAND_BYTES] code bytes (the 8-bit wgmma layout: a thread's 4 consecutive bytes,
        i.e. 8 consecutive codes, of rows r and r + 8 per 16 bytes) and each row's factor for
        columns 0..31 and 32..63 -> [64, 64] bf16 in wgmma's operand layout, columns in
        ``x_column_order``."""
        del ctx
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape((WG_COLS, DEPTH)), dtype=object)
        results = llvm.StructType.get_literal([i32] * 4)
        for block, factor in enumerate((factor_lo, factor_hi)):  # 32 columns each
            for row in range(2):  # rows r and r + 8 of the thread's 16-row band
                f16 = arith.extui(i32, utils.bitcast(factor.registers[0, 0, row, 0, 0], i16))
                f2 = arith.ori(f16, arith.shli(f16, utils.c(16, i32)))  # the factor in both halves
                reg = codes.registers[0, block, 0, 0, row, 0, 0, 0, 0]
                regs = llvm.inline_asm(results, [utils.bitcast(reg, i32), f2], _pair_ptx(),
                                       "=r,=r,=r,=r,r,r")
                for j in range(4):
                    out[0, 4 * block + j, 0, 0, row, 0, 0, 0, 0] = utils.bitcast(
                        llvm.extractvalue(i32, regs, [j]), pair)
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return decode


def _body(meta_ref, x_ref, c1_ref, c3_ref, f1_ref, f3_ref, o_ref, *, n_programs: int,
          n_groups: int, stages: int, finish):
    """One persistent CTA: the table's programs, each [ROWS, COLS] of SiTU(x W1^T, x W3^T) from
    the codes and factors of weight rows [COLS block, all of K]."""
    k_steps = x_ref.shape[1] // STEP_K

    def pipeline(step, context):
        # no release delay, unlike the bf16 kernel: a step's products end within it (docstring)
        spec = lambda shape, index, tiles=(): plgpu.BlockSpec(  # noqa: E731
            shape, index, transforms=tiles, delay_release=0)
        code_spec = spec((COLS, STEP_BYTES), lambda k: (0, k), CODE_TILES)
        factor_spec = spec((STEP_K // BLOCK, COLS), lambda k: (k, 0))
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=MEMORY_REGISTERS,
            in_specs=[spec((ROWS, STEP_K), lambda k: (0, k), TILES), code_spec, code_spec,
                      factor_spec, factor_spec],
            max_concurrent_steps=stages, wg_axis="wg", num_compute_wgs=2, compute_context=context)

    def blocks(group, first_col):
        cols = pl.ds(first_col, COLS)
        return (c1_ref.at[group, cols], c3_ref.at[group, cols], f1_ref.at[group, :, cols],
                f3_ref.at[group, :, cols])

    ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)
    allocations = pipeline(ignore, ignore).get_allocations(x_ref.at[pl.ds(0, ROWS)], *blocks(0, 0))

    def scope(buffers, staging):
        w = lax.axis_index("wg")

        @plgpu.nd_loop((n_programs,), collective_axes="sm")
        def _(info):
            (p,) = info.index
            load, row_start, row_end, group, block = program_row(meta_ref, p)
            count = row_end - row_start
            real = group < n_groups  # the virtual expert past sum(group_sizes) stores zeros
            col0 = pl.multiple_of(block * COLS + w * WG_COLS, WG_COLS)

            def stage_and_store(h_t):
                """A warpgroup's [64 weight rows, 128 token rows] result, transposed, to HBM in
                parts of STORE_ROWS token rows, each part's rows of this program only."""
                for part in range(ROWS // STORE_ROWS):
                    part_load = load + part * STORE_ROWS
                    first, part_count = rows_in_window(row_start, row_end, part_load, STORE_ROWS)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging buffer is free
                    store_transposed_wgmma(staging.at[w],
                                      h_t[:, part * STORE_ROWS:(part + 1) * STORE_ROWS])
                    plgpu.commit_smem()
                    store_rows(staging.at[w], o_ref.at[:, pl.ds(col0, WG_COLS)],
                                first - part_load, first, part_count)

            def context(run):
                def accumulate(gate, up):
                    run((gate, up))
                    stage_and_store(finish(gate[...], up[...]).astype(o_ref.dtype))

                pl.run_scoped(accumulate, *(plgpu.ACC((WG_COLS, ROWS), _F32) for _ in range(2)))

            def step(_, x_s, c1_s, c3_s, f1_s, f3_s, accs):
                mine = pl.ds(pl.multiple_of(w * WG_COLS, WG_COLS), WG_COLS)
                for half in range(STEP_K // DEPTH):  # each decode runs while the last product does
                    tokens = x_s.at[:, pl.ds(half * DEPTH, DEPTH)].transpose((1, 0))  # [K, ROWS]
                    for acc, c_s, f_s in zip(accs, (c1_s, c3_s), (f1_s, f3_s)):
                        # loaded here, after the last product was issued: ptxas keeps shared-memory
                        # loads behind it, and with them this decode (codes loaded once a step let
                        # it hoist every decode of the step ahead of the first product)
                        code = plgpu.load(c_s.at[mine, pl.ds(half * OPERAND_BYTES, OPERAND_BYTES)],
                                          layout=plgpu.Layout.WGMMA_8BIT)
                        factors = (plgpu.load(f_s.at[2 * half + b, mine], layout=_ROW, optimized=False)
                                   for b in range(DEPTH // BLOCK))
                        plgpu.wgmma(acc, _decoder()(code, *factors), tokens)
                # all done before the step ends: a wgmma still reading registers across the loop's
                # back edge came out wrong (NaN) on the H200, and the slot is released after the step
                plgpu.wgmma_wait(0)
                return accs

            def store_zeros():  # jnp.zeros is a splat: give it the transposed store's layout
                stage_and_store(plgpu.layout_cast(jnp.zeros((WG_COLS, ROWS), o_ref.dtype),
                                                  plgpu.Layout.WGMMA))

            run_program(count, real, w, lambda: pipeline(step, context)(
                x_ref.at[pl.ds(pl.multiple_of(load, ALIGN), ROWS)],
                *blocks(group, pl.multiple_of(block * COLS, COLS)), allocations=buffers), store_zeros)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, allocations, plgpu.SMEM((2, STORE_ROWS, WG_COLS), o_ref.dtype),
                  collective_axes="wg")


def fits(k: int, n: int) -> bool:
    """Whether gate and up weights [E, n, k] (decoded shape) tile this kernel's steps and columns."""
    return k % STEP_K == 0 and n % COLS == 0


@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "num_sms", "stages"))
def gate_up_situ_mxfp4_mgpu(x_ordered: jax.Array, packed1: jax.Array, scale1: jax.Array,
                            packed3: jax.Array, scale3: jax.Array, group_sizes: jax.Array, *,
                            beta: float = 4.0, linear_beta: float | None = 25.0,
                            num_sms: int | None = None, stages: int = STAGES) -> jax.Array:
    """SiTU(x @ W1_e^T, x @ W3_e^T) for rows grouped by expert, W1 and W3 as the release stores them:
    packed uint8 [E, N, K/2] (two E2M1 codes a byte, the even column in the low nibble) and E8M0
    scale bytes [E, N, K/32]. x_ordered [M, K] bf16 is x[:, x_column_order(K)], rows sorted by
    expert -> [M, N] bf16. Hopper only (the decode is PTX; no interpreter form)."""
    e, n, half_k = packed1.shape
    k = 2 * half_k
    weights = (packed1, scale1, packed3, scale3)
    if (x_ordered.dtype != _BF16 or x_ordered.ndim != 2 or x_ordered.shape[1] != k or k % STEP_K
            or n % COLS or any(w.dtype != jnp.uint8 for w in weights)
            or packed3.shape != packed1.shape or scale1.shape != (e, n, k // BLOCK)
            or scale3.shape != scale1.shape):
        raise ValueError(
            f"gate_up_situ_mxfp4_mgpu: wants bf16 x [M, K] and uint8 packed [E, N, K/2] and scales "
            f"[E, N, K/{BLOCK}] with K % {STEP_K} == 0 and N % {COLS} == 0; got x {x_ordered.dtype} "
            f"{x_ordered.shape}, " + ", ".join(f"{w.dtype} {w.shape}" for w in weights))
    m0 = x_ordered.shape[0]
    rows = max(ROWS, -(-m0 // ALIGN) * ALIGN)
    x = jnp.pad(x_ordered, ((0, rows - m0), (0, 0))) if rows != m0 else x_ordered
    meta = work_table(group_sizes, rows, n // COLS)
    fold = float(2 ** FOLD)
    situ = lambda g, u: situ_f32(g * fold, u * fold, beta, linear_beta)  # noqa: E731
    kernel = plgpu.kernel(
        functools.partial(_body, n_programs=meta.shape[0], n_groups=e, stages=stages, finish=situ),
        out_type=jax.ShapeDtypeStruct((rows, n), _BF16),
        grid=(num_sms or sm_count(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="k3_moe_gate_up_situ_mxfp4_mgpu",
    )
    return kernel(meta, x, packed1, packed3, scale_multipliers(scale1), scale_multipliers(scale3))[:m0]
