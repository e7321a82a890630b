"""Backward of the routed-expert MLP on rows sorted by expert: a `jax.custom_vjp` over the Pallas kernels.

Forward (per expert e, on its rows x_e):  g = x W1_e^T,  u = x W3_e^T,  h = SiTU(g, u),  y = h W2_e^T,
with SiTU(g, u) = b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2) in fp32 (fused gate+up kernel, then down GEMM).

Backward (analytic), nothing but the inputs is kept from the forward (g, u are recomputed, which costs two
grouped GEMMs but avoids keeping two [M, F] fp32 tensors alive between forward and backward; one gate+up
kernel with the derivative in its epilogue was timed on the H200 and was no faster, 6.78 vs 6.68 ms for the
whole forward + backward at 28 experts x 16384 rows):

  g, u      = x W1^T, x W3^T                          grouped_matmul (x2, fp32 out)
  h, dS/dg, dS/du                                      elementwise fp32 (XLA fuses it)
  dh        = dy W2_e                                  grouped_matmul on W2 as stored (weights_kn)
  dg, du    = dh * dS/dg, dh * dS/du                   elementwise fp32, rounded to the rows' dtype
  dx        = dg W1_e + du W3_e                        two grouped_matmuls (weights_kn), summed in fp32
  dW2_e     = dy_e^T h_e                               Pallas grouped_matmul_tn (contraction over rows)
  dW1_e, dW3_e = dg_e^T x_e, du_e^T x_e                Pallas grouped_matmul_tn, each written in the weights'
                                                       dtype from its fp32 accumulator

These five products run the Mosaic GPU kernel (``mosaic_gpu_grouped_gemm.grouped_matmul_mgpu``) where the
forward's down does without a tail (on the GPU, bf16, large groups: ``on_mosaic_gpu``), the Pallas-Triton ``grouped_matmul``
elsewhere. The three weight gradients contract over each expert's rows (a "transposed" grouped GEMM whose
output is one [P, Q] block per expert): `grouped_matmul_tn`, one program per (expert, output tile) looping
over the expert's row tiles; it equals `lax.ragged_dot_general` with a ragged contracting dimension
(`_ragged_rows_outer`, kept as its test oracle); its tiles are `bwd_cfg`'s (block_k 32 with 6 stages ran 5%
faster than the default 64 / 4 in one H200 job; expert load imbalance is not split across programs). The
products with the forward's weights load them as stored, [E, K, N] tiles (`weights_kn`), so no transposed or
concatenated copy of a layer's experts is made; the weight gradients are written in the weights' dtype
straight from the fp32 accumulators, not as fp32 arrays cast afterwards. Timed on the H200 at 28 experts
and at 112, the small-group tiles' path (weights as the MMA's left operand with [E, K, N] tiles; see
benchmarks/RESULTS.md).

SiTU derivative (fp32): with t1 = tanh(g/b1), s = sigmoid(g), gate = b1 t1 s,
  d gate / dg = (1 - t1^2) s + b1 t1 s (1 - s) = (1 - t1^2) s + gate (1 - s);
  up = b2 tanh(u/b2), d up / du = 1 - tanh^2(u/b2)   (up = u, derivative 1, when linear_beta is None);
  dS/dg = gate' * up,  dS/du = gate * up'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe import mosaic_gpu_grouped_gemm, mosaic_gpu_mxfp4
from pallas_kernels.moe.pallas_grouped_gemm import (
    DOWN_DEFAULT, DOWN_SMALL_GROUPS, GATE_UP_DEFAULT, GATE_UP_MXFP4, GATE_UP_SMALL_GROUPS, TileConfig,
    for_weights, grouped_gate_up_situ, grouped_matmul, grouped_matmul_tn,
)
from pallas_kernels.moe.reference import MXFP4Experts, decode_experts

F32 = jnp.float32

# x [M, in] (ragged rows) contracted with y [M, out] over the rows of each group -> [E, in, out].
_RAGGED_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def situ_and_grads(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None):
    """(SiTU(g, u), dSiTU/dg, dSiTU/du), all fp32, written out explicitly (not through autodiff)."""
    g, u = g.astype(F32), u.astype(F32)
    t1 = jnp.tanh(g * (1.0 / beta))
    s = 1.0 / (1.0 + jnp.exp(-g))  # as the kernel epilogue: accurate in relative terms for any g
    gate = beta * t1 * s
    dgate = (1.0 - t1 * t1) * s + gate * (1.0 - s)
    if linear_beta is None:
        up, dup = u, jnp.ones_like(u)
    else:
        t2 = jnp.tanh(u * (1.0 / linear_beta))
        up, dup = linear_beta * t2, 1.0 - t2 * t2
    return gate * up, dgate * up, gate * dup


def _ragged_rows_outer(a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Per group e: a_e^T b_e, a [M, P], b [M, Q] -> [E, P, Q] fp32 (rows past sum(group_sizes) ignored)."""
    return jax.lax.ragged_dot_general(a, b, group_sizes, _RAGGED_CONTRACT_ROWS, preferred_element_type=F32)


def _fit(cfg: TileConfig, k: int, n: int, w: "jax.Array | MXFP4Experts | None" = None) -> TileConfig:
    """cfg fitted to a GEMM with contraction K and output width N (against weight w: packed ones get the
    MXFP4 operand order and decoder, `for_weights`)."""
    from pallas_kernels.moe.pallas_experts import fit_config  # noqa: PLC0415 (avoid an import cycle)

    packed = isinstance(w, MXFP4Experts)
    return fit_config(for_weights(cfg, packed), k, n, k_multiple=32 if packed else 16)


def _fit_tn(cfg: TileConfig, p: int, q: int) -> TileConfig:
    """Tiles for grouped_matmul_tn (block_m: P tile, block_n: Q tile, block_k: row tile) dividing P and Q."""
    fitted = _fit(dataclasses.replace(cfg, block_k=cfg.block_m), p, q)  # fit_config shrinks block_k / block_n
    return dataclasses.replace(fitted, block_m=fitted.block_k, block_k=cfg.block_k)


def on_mosaic_gpu(rows, w, cfg: TileConfig, interpret: bool, weights_kn: bool = False) -> bool:
    """Whether a plain grouped GEMM of the backward runs the Mosaic GPU kernel
    (``grouped_matmul_mgpu``) instead of the Triton one: on the GPU, bf16 rows and weights, where
    the Triton kernel would take its large-group tiles (DOWN_DEFAULT; the forward's down:
    ``mosaic_gpu_down_tail``). The interpreter (CPU) keeps the Triton kernels, which the model's
    CPU tests run; the Mosaic GPU kernels have their own interpreter tests."""
    return (not interpret and cfg == DOWN_DEFAULT
            and mosaic_gpu_grouped_gemm.takes(rows, w, mosaic_gpu_grouped_gemm.PLAIN_COLS, weights_kn))


def mosaic_gpu_down_tail(h, w2, cfg: TileConfig, interpret: bool) -> int | None:
    """The forward down projection's ``tail_rows`` in the Mosaic GPU kernel, or None where the
    Triton kernel runs: plain 128-row tiles for large groups (DOWN_DEFAULT), 32-row tails merged
    into an expert's last tile for small ones (DOWN_SMALL_GROUPS: 430.6 TFLOP/s at 112 experts x
    16384 rows on the H200 against the Triton kernel's merged tails' 381.2 in the same rounds; on
    an H100, whose weight bandwidth bounds both, 336-340 against 345-347; benchmarks/RESULTS.md).
    Decode-sized batches and packed weights keep the Triton kernel."""
    if interpret or not mosaic_gpu_grouped_gemm.takes(h, w2, mosaic_gpu_grouped_gemm.PLAIN_COLS):
        return None
    return {DOWN_DEFAULT: 0, DOWN_SMALL_GROUPS: mosaic_gpu_grouped_gemm.TAIL_ROWS}.get(cfg)


def mosaic_gpu_gate_up_tail(rows, w1, cfg: TileConfig, interpret: bool) -> int | None:
    """The Mosaic GPU gate+up's ``tail_rows`` for these tiles, or None where the Triton kernel runs:
    plain 128-row tiles for large groups (``GATE_UP_DEFAULT``), 32-row tails merged into an
    expert's last tile for small ones (``GATE_UP_SMALL_GROUPS``: 477 TFLOP/s at 112 experts x 16384
    rows against the Triton kernel's 412 in the same rounds, benchmarks/RESULTS.md). Decode-sized
    batches keep the Triton kernel's 32-row tiles (reading the weights sets their time)."""
    if interpret or not mosaic_gpu_grouped_gemm.takes(rows, w1, mosaic_gpu_grouped_gemm.GATE_UP_COLS):
        return None
    return {GATE_UP_DEFAULT: 0, GATE_UP_SMALL_GROUPS: mosaic_gpu_grouped_gemm.TAIL_ROWS}.get(cfg)


def _forward(rows, w1, w2, w3, group_sizes, beta, linear_beta, interpret, gate_up_cfg, down_cfg):
    hidden, d_in, d_out = w1.shape[1], rows.shape[1], w2.shape[1]
    if not interpret and gate_up_cfg == GATE_UP_MXFP4 and mosaic_gpu_mxfp4.takes(rows, w1, w3):
        # packed weights, large groups: decoded in registers (rows' columns in the decode's order)
        rows_ordered = rows[:, mosaic_gpu_mxfp4.x_column_order(d_in)]
        h = mosaic_gpu_mxfp4.gate_up_situ_mxfp4_mgpu(rows_ordered, w1.packed, w1.scale, w3.packed,
                                                     w3.scale, group_sizes, beta=beta,
                                                     linear_beta=linear_beta)
    elif (tail_rows := mosaic_gpu_gate_up_tail(rows, w1, gate_up_cfg, interpret)) is not None:
        h = mosaic_gpu_grouped_gemm.gate_up_situ_mgpu(rows, w1, w3, group_sizes, beta=beta,
                                                      linear_beta=linear_beta, tail_rows=tail_rows)
    else:
        h = grouped_gate_up_situ(rows, w1, w3, group_sizes, beta=beta, linear_beta=linear_beta,
                                 cfg=_fit(gate_up_cfg, d_in, hidden, w1), interpret=interpret)
    if (tail_rows := mosaic_gpu_down_tail(h, w2, down_cfg, interpret)) is not None:
        return mosaic_gpu_grouped_gemm.grouped_matmul_mgpu(h, w2, group_sizes, tail_rows=tail_rows)
    return grouped_matmul(h, w2, group_sizes, cfg=_fit(down_cfg, hidden, d_out, w2), interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def expert_mlp(rows, w1, w2, w3, group_sizes, beta, linear_beta, interpret, gate_up_cfg, down_cfg, bwd_cfg):
    """SiTU-GLU expert MLP on rows sorted by expert: [M, in] -> [M, out] in rows.dtype, with a custom VJP.

    rows [M, in]; w1, w3 [E, F, in]; w2 [E, out, F]; in, F, out multiples of 16. group_sizes [E] int32 (no
    gradient). bwd_cfg: tiles of the backward's grouped GEMMs (shrunk per GEMM to divide its widths).
    Weights may be `MXFP4Experts` (decoded per tile inside the forward kernels); the backward decodes those
    in XLA for dx and gives them no gradient (integer codes), skipping their weight-gradient GEMMs.
    """
    return _forward(rows, w1, w2, w3, group_sizes, beta, linear_beta, interpret, gate_up_cfg, down_cfg)


def _expert_mlp_fwd(rows, w1, w2, w3, group_sizes, beta, linear_beta, interpret, gate_up_cfg, down_cfg,
                    bwd_cfg):
    out = _forward(rows, w1, w2, w3, group_sizes, beta, linear_beta, interpret, gate_up_cfg, down_cfg)
    return out, (rows, w1, w2, w3, group_sizes)


def _expert_mlp_bwd(beta, linear_beta, interpret, gate_up_cfg, down_cfg, bwd_cfg, res, dy):
    rows, *stored, group_sizes = res
    w1, w2, w3 = (decode_experts(w, rows.dtype) for w in stored)
    hidden, d_in, d_out = w1.shape[1], rows.shape[1], w2.shape[1]

    def gemm(x, w, k: int, n: int, weights_kn: bool = False) -> jax.Array:
        """fp32 x @ w_e^T (x @ w_e with weights_kn); Mosaic GPU where the Triton kernel would take its
        large-group tiles, as in the forward."""
        if on_mosaic_gpu(x, w, bwd_cfg, interpret, weights_kn):
            return mosaic_gpu_grouped_gemm.grouped_matmul_mgpu(x, w, group_sizes, out_dtype=F32,
                                                               weights_kn=weights_kn)
        return grouped_matmul(x, w, group_sizes, cfg=_fit(bwd_cfg, k, n, w), out_dtype=F32,
                              interpret=interpret, weights_kn=weights_kn)

    # recompute gate and up (fp32 accumulators, as the fused kernel's epilogue sees them)
    g = gemm(rows, stored[0], d_in, hidden)  # packed: decoded per tile
    u = gemm(rows, stored[2], d_in, hidden)
    h, dsdg, dsdu = situ_and_grads(g, u, beta, linear_beta)
    h = h.astype(rows.dtype)  # the forward's rounding of the hidden state (the down GEMM's operand)
    dy = dy.astype(rows.dtype)
    # the forward's weights as they are ([E, K, N] for these products): no transposed copy of the layer
    dh = gemm(dy, w2, d_out, hidden, weights_kn=True)  # [M, F] fp32
    dg, du = ((dh * d).astype(rows.dtype) for d in (dsdg, dsdu))
    dx = gemm(dg, w1, hidden, d_in, weights_kn=True) + gemm(du, w3, hidden, d_in, weights_kn=True)  # fp32
    packed = [isinstance(w, MXFP4Experts) for w in stored]  # no gradient for integer codes
    tn = functools.partial(grouped_matmul_tn, group_sizes=group_sizes, interpret=interpret)  # fp32 accumulation
    dw1 = dw2 = dw3 = None
    if not packed[1]:
        dw2 = tn(dy, h, cfg=_fit_tn(bwd_cfg, d_out, hidden), out_dtype=w2.dtype)  # [E, out, F]
    if not packed[0]:
        dw1 = tn(dg, rows, cfg=_fit_tn(bwd_cfg, hidden, d_in), out_dtype=w1.dtype)  # [E, F, in]
    if not packed[2]:
        dw3 = tn(du, rows, cfg=_fit_tn(bwd_cfg, hidden, d_in), out_dtype=w3.dtype)
    return (dx.astype(rows.dtype), dw1, dw2, dw3, None)


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
