"""The "pallas_gpu" implementation of the routed experts: Pallas kernels for NVIDIA GPUs, each product
on the Triton or the Mosaic GPU kernel, as `plan_kernels` decides from the problem alone.

Mosaic GPU (warp-specialised, persistent, TMA + wgmma) takes the bf16 products of batches past decode
size that tile its blocks: the forward's gate+up and down (an expert's remainder of up to TAIL_ROWS rows
merged into its last tile where groups are small) and, for large groups, the backward's products with
the forward's weights. Its MXFP4 gate+up decodes packed gate and up weights in registers for large
groups, where the Triton tile decode would cost more than the MMAs. Triton takes the rest: decode-sized
batches (reading the weights sets their time; MXFP4 weights stay packed and are decoded per tile), the
weight gradients, and everything in interpret mode (CPU, tests). Where a product does not read MXFP4
weights packed they are decoded to the rows' dtype first (a transient copy of one layer's experts).
All products are exact up to the order of fp32 sums, so every choice gives the same model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.moe import mosaic_gpu, triton
from pallas_kernels.moe.batch_size import is_decode_sized
from pallas_kernels.moe.mosaic_gpu import gate_up_mxfp4, grouped_gemm
from pallas_kernels.moe.reference import Weights
from pallas_kernels.moe.triton.tiles import TileConfig, fit_config, fit_tn_config, has_small_groups
from pallas_kernels.moe.vjp import GroupedProducts, expert_mlp
from pallas_kernels.mxfp4 import MXFP4Experts, decode_experts
from pallas_kernels.platform import current_platform

F32, BF16 = jnp.float32, jnp.bfloat16
Kernel = Literal["triton", "mosaic_gpu"]


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Which kernel runs each product of one call, and which weights reach the kernels packed."""

    interpret: bool  # Pallas interpret mode (off a GPU): Triton kernels only
    packed_gate_up: bool  # w1, w3 reach the kernels MXFP4-packed (else decoded first)
    packed_down: bool  # w2 likewise
    gate_up: Literal["triton", "mosaic_gpu", "mosaic_gpu_mxfp4"]
    down: Kernel
    tail_rows: int  # the Mosaic GPU forward products' merged tail: 0 or mosaic_gpu.TAIL_ROWS
    recompute: Kernel  # backward: gate and up recomputed
    dh: Kernel  # backward: dy W2
    dx: Kernel  # backward: dg W1, du W3


def plan_kernels(*, dtype, weight_dtype, packed: bool, num_rows: int, num_experts: int, d_in: int,
                 hidden: int, d_out: int, interpret: bool) -> KernelPlan:
    """The kernels for `num_rows` rows (x `dtype`) grouped over `num_experts` experts with widths
    d_in -> hidden -> d_out (as the kernels see them, zero-padded to multiples of 16); weights MXFP4
    (`packed`) or dense of `weight_dtype`. Static shapes only: group sizes are data, so group size
    means the average rows per expert."""
    decode_sized = is_decode_sized(num_rows, num_experts)
    large = not has_small_groups(num_rows, num_experts)
    on_gpu = not interpret
    bf16 = jnp.dtype(dtype) == BF16
    mxfp4_gate_up = on_gpu and packed and bf16 and large and gate_up_mxfp4.fits(d_in, hidden)
    packed_gate_up = packed and (decode_sized or mxfp4_gate_up)
    packed_down = packed and decode_sized
    dense_bf16 = bf16 and (packed or jnp.dtype(weight_dtype) == BF16)  # bf16 weights once MXFP4 is decoded
    mosaic_forward = on_gpu and not decode_sized and dense_bf16
    mosaic_backward = on_gpu and large and dense_bf16
    plain = functools.partial(grouped_gemm.fits, block_cols=mosaic_gpu.PLAIN_COLS)
    if mxfp4_gate_up:
        gate_up = "mosaic_gpu_mxfp4"
    elif mosaic_forward and not packed_gate_up and grouped_gemm.fits(d_in, hidden, mosaic_gpu.GATE_UP_COLS):
        gate_up = "mosaic_gpu"
    else:
        gate_up = "triton"
    pick = lambda mosaic: "mosaic_gpu" if mosaic else "triton"  # noqa: E731
    return KernelPlan(
        interpret=interpret, packed_gate_up=packed_gate_up, packed_down=packed_down, gate_up=gate_up,
        down=pick(mosaic_forward and not packed_down and plain(hidden, d_out)),
        tail_rows=0 if large else mosaic_gpu.TAIL_ROWS,
        recompute=pick(mosaic_backward and not packed_gate_up and plain(d_in, hidden)),
        dh=pick(mosaic_backward and plain(d_out, hidden)),
        dx=pick(mosaic_backward and plain(hidden, d_in)),
    )


def _pad16(a: Weights, axis: int) -> Weights:
    """Zero-pad one axis up to a multiple of 16 (a no-op, and no copy, for the model's real widths).

    Zero K columns add nothing, zero gate/up rows give SiTU(0, 0) = 0 hidden units, and padded output
    columns are sliced off. MXFP4 weights pad their rows (zero codes decode to zero); their input width
    is a multiple of 32 by format, so padding it is always a no-op."""
    if isinstance(a, MXFP4Experts):
        if axis in (-1, a.packed.ndim - 1):
            return a
        return MXFP4Experts(_pad16(a.packed, axis), _pad16(a.scale, axis))
    extra = -a.shape[axis] % 16
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _products(plan: KernelPlan, gate_up_cfg: TileConfig, down_cfg: TileConfig,
              bwd_cfg: TileConfig) -> GroupedProducts:
    """The plan's kernels as the custom VJP's products (Triton tiles fitted to each product's widths)."""
    interpret = plan.interpret

    def gate_up_situ(rows, w1, w3, group_sizes, beta, linear_beta):
        if plan.gate_up == "mosaic_gpu_mxfp4":  # x's columns in the register decode's order
            rows = rows[:, mosaic_gpu.x_column_order(rows.shape[1])]
            return mosaic_gpu.gate_up_situ_mxfp4_mgpu(rows, w1.packed, w1.scale, w3.packed, w3.scale,
                                                      group_sizes, beta=beta, linear_beta=linear_beta)
        if plan.gate_up == "mosaic_gpu":
            return mosaic_gpu.gate_up_situ_mgpu(rows, w1, w3, group_sizes, beta=beta, linear_beta=linear_beta,
                                                tail_rows=plan.tail_rows)
        cfg = fit_config(gate_up_cfg, rows.shape[1], w1.shape[1], mxfp4=isinstance(w1, MXFP4Experts))
        return triton.grouped_gate_up_situ(rows, w1, w3, group_sizes, beta=beta, linear_beta=linear_beta,
                                           cfg=cfg, interpret=interpret)

    def down(h, w2, group_sizes):
        if plan.down == "mosaic_gpu":
            return mosaic_gpu.grouped_matmul_mgpu(h, w2, group_sizes, tail_rows=plan.tail_rows)
        cfg = fit_config(down_cfg, h.shape[1], w2.shape[1], mxfp4=isinstance(w2, MXFP4Experts))
        return triton.grouped_matmul(h, w2, group_sizes, cfg=cfg, interpret=interpret)

    def product(kernel: Kernel, weights_kn: bool):
        """fp32 x @ w_e^T (x @ w_e with weights_kn) on `kernel`."""
        def run(x, w, group_sizes):
            if kernel == "mosaic_gpu":
                return mosaic_gpu.grouped_matmul_mgpu(x, w, group_sizes, out_dtype=F32, weights_kn=weights_kn)
            k, n = (w.shape[1], w.shape[2]) if weights_kn else (x.shape[1], w.shape[1])
            cfg = fit_config(bwd_cfg, k, n, mxfp4=isinstance(w, MXFP4Experts))
            return triton.grouped_matmul(x, w, group_sizes, cfg=cfg, out_dtype=F32, interpret=interpret,
                                         weights_kn=weights_kn)
        return run

    def weight_grad(a, b, group_sizes, out_dtype):
        cfg = fit_tn_config(bwd_cfg, a.shape[1], b.shape[1])
        return triton.grouped_matmul_tn(a, b, group_sizes, cfg=cfg, out_dtype=out_dtype, interpret=interpret)

    return GroupedProducts(gate_up_situ=gate_up_situ, down=down, gate_up=product(plan.recompute, False),
                           dh=product(plan.dh, True), dx=product(plan.dx, True), weight_grad=weight_grad)


def grouped_mlp(rows: jax.Array, group_sizes: jax.Array, w1: Weights, w2: Weights, w3: Weights,
                *, beta: float, linear_beta: float | None, gate_up_cfg: TileConfig | None = None,
                down_cfg: TileConfig | None = None, bwd_cfg: TileConfig | None = None) -> jax.Array:
    """SiTU-GLU of rows grouped by expert on the Pallas GPU kernels -> [M, out] in rows.dtype; rows past
    sum(group_sizes) come out zero. Differentiable in rows and dense weights (`vjp.expert_mlp`).

    rows [M, in]; group_sizes [E] int32; w1, w3 [E, F, in], w2 [E, out, F], dense or `MXFP4Experts`.
    gate_up_cfg, down_cfg, bwd_cfg: Triton tiles instead of the defaults (`triton.gate_up_config`,
    `triton.down_config`), fitted to each product's widths; they never change which kernel runs."""
    num_rows, num_experts, d_out = rows.shape[0], w1.shape[0], w2.shape[1]
    packed = isinstance(w1, MXFP4Experts)
    pad = lambda d: -(-d // 16) * 16  # noqa: E731
    plan = plan_kernels(dtype=rows.dtype, weight_dtype=None if packed else w1.dtype, packed=packed,
                        num_rows=num_rows, num_experts=num_experts, d_in=pad(rows.shape[1]),
                        hidden=pad(w1.shape[1]), d_out=pad(d_out), interpret=current_platform() != "gpu")
    if not plan.packed_gate_up:
        w1, w3 = (decode_experts(w, rows.dtype) for w in (w1, w3))
    if not plan.packed_down:
        w2 = decode_experts(w2, rows.dtype)
    rows = _pad16(rows, 1)
    w1, w3 = (_pad16(_pad16(w, 2), 1) for w in (w1, w3))
    w2 = _pad16(_pad16(w2, 2), 1)
    gate_up_cfg = gate_up_cfg or triton.gate_up_config(num_rows, num_experts, plan.packed_gate_up)
    down_cfg = down_cfg or triton.down_config(num_rows, num_experts, plan.packed_down)
    bwd_cfg = bwd_cfg or triton.down_config(num_rows, num_experts, backward=True)
    products = _products(plan, gate_up_cfg, down_cfg, bwd_cfg)
    outs = expert_mlp(rows, w1, w2, w3, group_sizes, products, float(beta),
                      None if linear_beta is None else float(linear_beta))
    return outs[:, :d_out]
