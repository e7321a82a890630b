"""The routed experts' MLP on rows sorted by expert, as a `jax.custom_vjp` over a backend's kernels.

Forward (per expert e, on its rows x_e):  g = x W1_e^T,  u = x W3_e^T,  h = SiTU(g, u),  y = h W2_e^T,
with SiTU in fp32 (the backend's fused gate+up kernel, then its down product).

Backward (analytic), nothing but the inputs is kept from the forward: g and u are recomputed, which
costs two grouped GEMMs but avoids keeping two [M, F] fp32 tensors alive between forward and backward
(one gate+up kernel with the derivative in its epilogue was tried and was no faster):

  g, u      = x W1^T, x W3^T                          `gate_up` (x2, fp32 out)
  h, dS/dg, dS/du                                      elementwise fp32 (`epilogue.situ_and_grads`)
  dh        = dy W2_e                                  `dh`, on W2 as stored ([E, K, N] tiles)
  dg, du    = dh * dS/dg, dh * dS/du                   elementwise fp32, rounded to the rows' dtype
  dx        = dg W1_e + du W3_e                        `dx` (x2, weights as stored), summed in fp32
  dW2_e     = dy_e^T h_e                               `weight_grad` (a contraction over each expert's rows)
  dW1_e, dW3_e = dg_e^T x_e, du_e^T x_e                `weight_grad`, each written in the weights' dtype
                                                       from its fp32 accumulator

The products with the forward's weights load them as stored, so no transposed or concatenated copy of
a layer's experts is made. MXFP4 weights get no gradient (integer codes): the backward decodes them for
dx and skips their weight-gradient GEMMs. A backend without backward kernels (`gate_up` None) gets the
gradients of the XLA reference (`reference.grouped_mlp_ragged_dot`), recomputed from the inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.moe.epilogue import situ_and_grads
from pallas_kernels.moe.reference import Weights, grouped_mlp_ragged_dot
from pallas_kernels.mxfp4 import MXFP4Experts, decode_experts

F32 = jnp.float32


class GroupedProducts(NamedTuple):
    """One backend's kernels for the MLP on rows grouped by expert (`group_sizes` [E] int32 in each).

    gate_up_situ(rows, w1, w3, group_sizes, beta, linear_beta) -> [M, F] in rows.dtype;
    down(h, w2, group_sizes) -> [M, out] in rows.dtype or fp32;
    backward products, all None for the reference's gradients:
    gate_up(rows, w, group_sizes) -> fp32 rows @ w_e^T (w1 or w3 as the forward got them);
    dh(dy, w2, group_sizes) -> fp32 dy @ w2_e, w2 dense [E, out, F];
    dx(dg, w, group_sizes) -> fp32 dg @ w_e, w dense [E, F, in];
    weight_grad(a, b, group_sizes, out_dtype) -> [E, P, Q] = a_e^T b_e per expert.
    """

    gate_up_situ: Callable[..., jax.Array]
    down: Callable[..., jax.Array]
    gate_up: Callable[..., jax.Array] | None = None
    dh: Callable[..., jax.Array] | None = None
    dx: Callable[..., jax.Array] | None = None
    weight_grad: Callable[..., jax.Array] | None = None


def _forward(rows, w1, w2, w3, group_sizes, products: GroupedProducts, beta, linear_beta):
    h = products.gate_up_situ(rows, w1, w3, group_sizes, beta, linear_beta)
    return products.down(h, w2, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def expert_mlp(rows: jax.Array, w1: Weights, w2: Weights, w3: Weights, group_sizes: jax.Array,
               products: GroupedProducts, beta: float, linear_beta: float | None) -> jax.Array:
    """SiTU-GLU expert MLP on rows sorted by expert, [M, in] -> [M, out], with a custom VJP.

    rows [M, in]; w1, w3 [E, F, in]; w2 [E, out, F], dense or `MXFP4Experts` as the backend's kernels
    take them; group_sizes [E] int32 (no gradient)."""
    return _forward(rows, w1, w2, w3, group_sizes, products, beta, linear_beta)


def _expert_mlp_fwd(rows, w1, w2, w3, group_sizes, products, beta, linear_beta):
    out = _forward(rows, w1, w2, w3, group_sizes, products, beta, linear_beta)
    return out, (rows, w1, w2, w3, group_sizes)


def _reference_bwd(beta, linear_beta, res, dy):
    """Gradients of the XLA reference, recomputed from the inputs (backends without backward kernels)."""
    rows, *weights, group_sizes = res

    def reference(rows, w1, w2, w3):
        out = grouped_mlp_ragged_dot(rows, group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta)
        return out.astype(dy.dtype)

    _, vjp = jax.vjp(reference, rows, *weights)
    return (*vjp(dy), None)


def _expert_mlp_bwd(products: GroupedProducts, beta, linear_beta, res, dy):
    if products.gate_up is None:
        return _reference_bwd(beta, linear_beta, res, dy)
    rows, *stored, group_sizes = res
    w1, w2, w3 = (decode_experts(w, rows.dtype) for w in stored)
    # recompute gate and up (fp32 accumulators, as the fused kernel's epilogue sees them)
    g = products.gate_up(rows, stored[0], group_sizes)  # packed: decoded per tile
    u = products.gate_up(rows, stored[2], group_sizes)
    h, dsdg, dsdu = situ_and_grads(g, u, beta, linear_beta)
    h = h.astype(rows.dtype)  # the forward's rounding of the hidden state (the down GEMM's operand)
    dy = dy.astype(rows.dtype)
    dh = products.dh(dy, w2, group_sizes)  # [M, F] fp32
    dg, du = ((dh * d).astype(rows.dtype) for d in (dsdg, dsdu))
    dx = products.dx(dg, w1, group_sizes) + products.dx(du, w3, group_sizes)  # fp32
    packed = [isinstance(w, MXFP4Experts) for w in stored]  # no gradient for integer codes
    tn = functools.partial(products.weight_grad, group_sizes=group_sizes)  # fp32 accumulation
    dw1 = None if packed[0] else tn(dg, rows, out_dtype=w1.dtype)  # [E, F, in]
    dw2 = None if packed[1] else tn(dy, h, out_dtype=w2.dtype)  # [E, out, F]
    dw3 = None if packed[2] else tn(du, rows, out_dtype=w3.dtype)
    return (dx.astype(rows.dtype), dw1, dw2, dw3, None)


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
