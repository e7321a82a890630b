"""The grouped (ragged) GEMM kernel for the routed experts, in Pallas lowered through Triton.

One kernel body serves the fused gate+up (two fp32 accumulators of the same (row tile, column tile), fed
from one load of the x tile, with the SiTU product taken in fp32 in the epilogue, so neither the [M, F]
gate nor the up tensor is ever written to device memory) and the plain product (one accumulator, a cast
in the epilogue).

Layout: rows of ``x`` [M, K] are sorted by expert; weights keep the release layout [E, N, K] (``out, in``),
so a weight tile is read K-contiguous and fed to the MMA transposed (no host-side transpose); ``kn``
weights are stored [E, K, N] (the backward's products with the forward's weights). A program's row tile
always loads a full tile of rows (its start is shifted back at the end of x so the load stays in bounds)
and stores only its own rows under a mask, so no padding copy of x is needed. MXFP4 weights: each k step
loads the packed [bn, bk/2] code tile and its [bn, bk/32] scales and decodes them to x's dtype in
registers (`mxfp4.decode_tile`), so no decoded copy of the layer is ever written.

Why Pallas-Triton (next to the Mosaic GPU kernels, mosaic_gpu/): it runs unchanged under ``interpret=True``
on CPU at any grid size, which is what the tests have, and lowers to Triton IR on a CPU machine, so
lowering errors are caught before any device time is spent; masked stores and data-dependent tile
metadata are one line each. The Triton compiler chooses the MMA instructions, the async-copy pipeline
(``num_stages``) and the register layout. Without TMA multicast, a warp-specialised producer or a
persistent grid its ceiling is that of a good non-persistent Triton GEMM, so the forward's large-group
products and the backward's products with the forward's weights run Mosaic GPU where it fits
(`pallas_gpu.plan_kernels`); this kernel keeps the small-group, decode-sized, MXFP4 and interpret-mode
cases and the weight gradients. Pallas-Triton is deprecated after JAX 0.11: pin jax<0.12 or port it.
Pallas-Triton computes 32-bit element offsets and switches to 64-bit by itself for operands over 4 GiB,
so the expert count is not bounded by indexing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import ptx_math
from pallas_kernels.moe.epilogue import situ_f32
from pallas_kernels.moe.triton.schedule import merged_tail_rows, schedule
from pallas_kernels.moe.triton.tiles import TileConfig
from pallas_kernels.mxfp4 import BLOCK, MXFP4Experts, decode_tile

F32 = jnp.float32
Weight = jax.Array | MXFP4Experts  # [E, N, K] dense, or packed codes [E, N, K/2] + scales [E, N, K/32]


def _situ(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None, approx: bool) -> jax.Array:
    """The fused epilogue's SiTU. With ``approx`` (on the GPU, bf16 outputs): the PTX tanh.approx.f32
    (one MUFU op, relative error ~2^-11, below the bf16 output's rounding of 2^-9) and the sigmoid from
    ex2.approx and rcp.approx (``ptx_math.sigmoid``: four instructions instead of about eighteen)."""
    if approx:
        return situ_f32(g, u, beta, linear_beta, tanh=pltr.approx_tanh, sigmoid=ptx_math.sigmoid)
    return situ_f32(g, u, beta, linear_beta)


def _weight_tile(w_refs, grp, n0, k0, bn: int, bk: int, dtype, kn: bool) -> jax.Array:
    """The [bn, bk] weight tile of expert grp at (n0, k0) ([bk, bn] when the weights are stored [E, K, N],
    ``kn``): a plain load, or packed codes + scales decoded."""
    if len(w_refs) == 1:
        if kn:
            return w_refs[0][grp, pl.ds(k0, bk), pl.ds(n0, bn)]
        return w_refs[0][grp, pl.ds(n0, bn), pl.ds(k0, bk)]
    packed_ref, scale_ref = w_refs
    packed = packed_ref[grp, pl.ds(n0, bn), pl.ds(pl.multiple_of(k0 // 2, bk // 2), bk // 2)]
    scale = scale_ref[grp, pl.ds(n0, bn), pl.ds(pl.multiple_of(k0 // BLOCK, bk // BLOCK), bk // BLOCK)]
    return decode_tile(packed, scale, dtype)


def _kernel(meta_ref, x_ref, *refs, num_rows, num_groups, cfg: TileConfig, fused: bool, mxfp4: bool, beta,
            linear_beta, approx: bool, kn: bool):
    per_weight = 2 if mxfp4 else 1  # refs: (packed, scale) per MXFP4 weight, else one array
    w1_refs = refs[:per_weight]
    w3_refs = refs[per_weight:2 * per_weight] if fused else None
    o_ref = refs[-1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    num_k = x_ref.shape[1] // bk
    pid = pl.program_id(0)
    row_start = meta_ref[pid, 0]
    row_end = meta_ref[pid, 1]
    grp = meta_ref[pid, 2]
    n0 = pl.multiple_of(meta_ref[pid, 3] * bn, bn)
    active = row_start < row_end
    w_contract = 0 if kn else 1  # the weight tile's k axis: [bk, bn] or [bn, bk]

    def mma(xt, wt):
        if cfg.weights_lhs:  # [bn, rows]
            return jax.lax.dot_general(wt, xt, (((w_contract,), (1,)), ((), ())), preferred_element_type=F32)
        return jax.lax.dot_general(xt, wt, (((1,), (w_contract,)), ((), ())), preferred_element_type=F32)

    def tile(heights: tuple[int, ...], compute: bool):
        """Load sum(heights) rows from an in-bounds start, as one MMA operand per height (a merged tile is
        (block_m, tail_m): Triton tiles are powers of two); store only rows [row_start, row_end)."""
        load_start = jnp.minimum(row_start, num_rows - sum(heights))
        offsets = [sum(heights[:i]) for i in range(len(heights))]
        if not compute:  # rows past sum(group_sizes)
            for h, off in zip(heights, offsets):
                store_part(load_start + off, h, jnp.zeros((h, bn), o_ref.dtype))
            return

        def body(k, accs):
            k0 = pl.multiple_of(k * bk, bk)
            xts = [x_ref[pl.ds(load_start + off, h), pl.ds(k0, bk)] for h, off in zip(heights, offsets)]
            new = []
            for i, w_refs in enumerate((w1_refs, w3_refs) if fused else (w1_refs,)):
                wt = _weight_tile(w_refs, grp, n0, k0, bn, bk, xts[0].dtype, kn)  # once for all parts
                new.append(tuple(acc + mma(xt, wt) for acc, xt in zip(accs[i], xts)))
            return tuple(new)

        zeros = tuple(jnp.zeros((bn, h) if cfg.weights_lhs else (h, bn), F32) for h in heights)
        accs = jax.lax.fori_loop(0, num_k, body, (zeros, zeros) if fused else (zeros,))
        for part, (h, off) in enumerate(zip(heights, offsets)):
            if fused:
                out = _situ(accs[0][part], accs[1][part], beta, linear_beta, approx)
            else:
                out = accs[0][part]
            out = out.astype(o_ref.dtype)
            store_part(load_start + off, h, out.T if cfg.weights_lhs else out)

    def store_part(start, height: int, value):
        rows = start + jax.lax.broadcasted_iota(jnp.int32, (height, bn), 0)
        mask = (rows >= row_start) & (rows < row_end)
        pltr.store(o_ref.at[pl.ds(start, height), pl.ds(n0, bn)], value, mask=mask)

    def run(compute: bool):
        """One tile shape per program, picked by its row count (tile shapes are static in Triton)."""
        if not cfg.tail_m:
            return tile((bm,), compute)
        count = row_end - row_start
        short = count <= cfg.tail_m
        pl.when(short)(lambda: tile((cfg.tail_m,), compute))
        pl.when(~short & (count <= bm))(lambda: tile((bm,), compute))
        if cfg.merge_tail:
            pl.when(count > bm)(lambda: tile((bm, cfg.tail_m), compute))

    real = grp < num_groups
    pl.when(active & real)(lambda: run(True))
    pl.when(active & ~real)(lambda: run(False))  # rows past sum(group_sizes)


def _check(x, ws, group_sizes, cfg: TileConfig, kn: bool) -> tuple[bool, int]:
    """Validate shapes and tiles; (whether the weights are MXFP4-packed, N)."""
    m, k = x.shape
    mxfp4 = isinstance(ws[0], MXFP4Experts)
    k_axis, layout = (1, f"[E, {k}, N]") if kn else (2, f"[E, N, {k}]")
    for name, w in zip(("w1", "w3"), ws):
        if isinstance(w, MXFP4Experts) != mxfp4:
            raise ValueError(f"{name}: gate and up weights must both be MXFP4Experts or both arrays")
        if kn and mxfp4:
            raise ValueError(f"{name}: weights_kn=True takes dense weights; MXFP4 ones are stored [E, N, K/2]")
        if (len(w.shape) != 3 or w.shape[k_axis] != k or w.shape[0] != group_sizes.shape[0]
                or w.shape != ws[0].shape):
            raise ValueError(f"{name} must be {layout} with E={group_sizes.shape[0]} (decoded shape); got {w.shape}")
        if mxfp4 and w.scale.shape != (*w.shape[:2], k // BLOCK):
            raise ValueError(f"{name}: MXFP4 scale must be {(*w.shape[:2], k // BLOCK)}, got {w.scale.shape}")
    n = ws[0].shape[2 if kn else 1]
    if k % cfg.block_k or n % cfg.block_n:
        raise ValueError(f"K={k} and N={n} must be multiples of block_k={cfg.block_k} / block_n={cfg.block_n}")
    if cfg.tail_m is not None and not (16 <= cfg.tail_m < cfg.block_m and cfg.tail_m & (cfg.tail_m - 1) == 0):
        raise ValueError(f"tail_m={cfg.tail_m}: must be a power of two in [16, block_m={cfg.block_m})")
    if cfg.merge_tail and not (cfg.tail_m and cfg.weights_lhs):
        raise ValueError(f"merge_tail needs tail_m and weights_lhs (the tail rows as the MMA's N); got {cfg.label()}")
    if mxfp4 and cfg.block_k % BLOCK:
        raise ValueError(f"block_k={cfg.block_k}: MXFP4 weights need a multiple of {BLOCK} (one scale per {BLOCK})")
    if m == 0:
        raise ValueError("x has no rows")
    return mxfp4, n


def grouped_call(x: jax.Array, ws: tuple[Weight, ...], group_sizes: jax.Array, *, cfg: TileConfig,
                 fused: bool, beta: float | None, linear_beta: float | None, out_dtype, interpret: bool,
                 kn: bool = False) -> jax.Array:
    """The kernel on x [M, K] against one weight (plain product) or two (``fused`` gate+up+SiTU) -> [M, N].
    The epilogue's SiTU takes the hardware approximations off interpret mode (`_situ`)."""
    mxfp4, n = _check(x, ws, group_sizes, cfg, kn)
    m0, _ = x.shape
    tallest = cfg.block_m + merged_tail_rows(cfg)
    if m0 < tallest:  # tiny inputs: pad rows so the tallest row tile is always in bounds
        x = jnp.pad(x, ((0, tallest - m0), (0, 0)))
    m = x.shape[0]
    meta = schedule(group_sizes, m, cfg.block_m, n // cfg.block_n, merged_tail_rows(cfg))
    kernel = functools.partial(_kernel, num_rows=m, num_groups=group_sizes.shape[0], cfg=cfg, fused=fused,
                               mxfp4=mxfp4, beta=beta, linear_beta=linear_beta, approx=not interpret, kn=kn)
    operands = [a for w in ws for a in ((w.packed, w.scale) if mxfp4 else (w,))]
    name = "k3_moe_gate_up_situ" if fused else "k3_moe_grouped_matmul"
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(meta.shape[0],),
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=name + ("_mxfp4" if mxfp4 else ""),
    )(meta, x, *operands)
    return out[:m0]
