"""Building blocks of the Pallas-Triton KDA intra-chunk kernels (forward and the backward's recompute).

Launch parameters, operand dtypes, K3's fused input activations, and the 16x16-block triangular
inverse: Pallas-Triton cannot slice register values, so the inverse kernel loads each block of
``L`` straight from its ref and stores each block of X as it comes (the callbacks of
``unit_lower_inverse``). Math: kda.md sections 2.1 / 2.4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import ptx_math
from pallas_kernels.kda.chunk_math import BC, NC
from pallas_kernels.kda.chunk_math import dot as _dot
from pallas_kernels.kda.reference import L2_NORM_EPS

try:  # Triton compiler params (GPU only); interpret mode ignores them.
    from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
    pl_triton = None

_F32 = jnp.float32


def compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """Triton launch parameters of a ``pl.pallas_call`` (none in interpret mode)."""
    if interpret or pl_triton is None:
        return {}
    return dict(compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages))


def triton_takes(*dims: int) -> bool:
    """Whether the Triton lowering takes these block widths: powers of two >= 16 (``tl.dot`` and
    ``tl.arange`` shapes). Interpret mode takes any."""
    return all(d >= 16 and d & (d - 1) == 0 for d in dims)


def matmul_dtypes(v: jax.Array) -> tuple[jnp.dtype, jnp.dtype]:
    """(matmul operand dtype, stored-intermediate dtype): IEEE fp32 throughout for fp32 inputs,
    else bf16 operands and intermediates in the input dtype (as fla)."""
    return (_F32, _F32) if v.dtype == _F32 else (jnp.bfloat16, v.dtype)


def unit_lower_inverse(load, put, mm_dtype=_F32) -> None:
    """X = (I + L)^{-1} by 16x16 blocks of a strictly lower L, in fp32, column by column.

    ``load(i, j)`` returns the block L[i, j] (j <= i); ``put(i, j, X_ij)`` takes each block of X
    (j <= i) as soon as it is known. Diagonal blocks: the exact Neumann product
    (I - L)(I + L^2)(I + L^4)(I + L^8) (L nilpotent of order 16); below them block forward
    substitution X_ij = -X_ii sum_{j<=m<i} L_im X_mj, one column j at a time, so that only the
    diagonal inverses and the current column are live: on one warp the row order (every block
    of X kept until all were stored) took all 255 registers. ``mm_dtype``: the products'
    ``chunk_math.dot`` mode, IEEE fp32 or ``BF16X3`` (for an X that is rounded to bf16
    afterwards).
    """
    mm = functools.partial(_dot, mm_dtype=mm_dtype)
    eye = jnp.eye(BC, dtype=_F32)

    def diagonal(Ld):
        P = eye - Ld
        Lp = mm(Ld, Ld)
        P = mm(P, eye + Lp)
        Lp = mm(Lp, Lp)
        P = mm(P, eye + Lp)
        Lp = mm(Lp, Lp)
        return mm(P, eye + Lp)

    diag = [diagonal(load(i, i)) for i in range(NC)]
    for j in range(NC):
        col = {j: diag[j]}
        put(j, j, diag[j])
        for i in range(j + 1, NC):
            acc = mm(load(i, j), col[j])
            for m in range(j + 1, i):
                acc = acc + mm(load(i, m), col[m])
            col[i] = -mm(diag[i], acc)
            put(i, j, col[i])


def approx_math(interpret: bool, mm_dtype) -> bool:
    """Whether a kernel takes ``ptx_math``'s single-instruction exp2 / reciprocal: on the GPU
    (interpret mode cannot lower them) for bf16 products, whose operands round far coarser."""
    return not interpret and mm_dtype != _F32


def gate_exp(approx: bool):
    """``(unit, exp)``: the unit in which a kernel keeps its log-decays and the exponential of
    them. Exact: natural logs and ``jnp.exp`` (libdevice ``expf``, ~8 instructions). With
    ``approx`` (GPU only, the bf16 path): log-decays in units of ln 2 (the factor folded into the
    gate) and ``ptx_math.exp2``, one instruction; its error adds ``|x| 2^-24`` from the
    log-decays' own rounding (below 6e-6 for ``|x| <= 128``), far below bf16's 2^-9."""
    if not approx:
        return 1.0, jnp.exp
    return ptx_math.LOG2E, ptx_math.exp2


def activations(fused: bool, lower_bound: float, gs_ref, db_ref, h, approx: bool = False):
    """(gate, l2, beta) input activations of one head in fp32: K3's fused ones
    (``g = lb * sigmoid(exp(A_log) (g_raw + dt_bias))``, ``x rsqrt(sum x^2 + eps)``, sigmoid),
    or identities on pre-activated inputs. The gate comes in ``gate_exp(approx)``'s unit; with
    ``approx`` its sigmoid is ``ptx_math.sigmoid``."""
    unit = gate_exp(approx)[0]
    if not fused:
        f32 = lambda x: x.astype(_F32)  # noqa: E731
        return ((lambda g: f32(g) * unit) if approx else f32), f32, beta_activation(False)
    gate_scale = gs_ref[h, :].astype(_F32)[None, :]
    dt_bias = db_ref[h, :].astype(_F32)[None, :]
    sigmoid = ptx_math.sigmoid if approx else jax.nn.sigmoid

    def gate(g):
        return (lower_bound * unit) * sigmoid(gate_scale * (g.astype(_F32) + dt_bias))

    def l2(x):
        x = x.astype(_F32)
        return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_NORM_EPS)

    return gate, l2, beta_activation(fused)


def beta_activation(fused: bool):
    """beta in fp32 from its input: a sigmoid of logits with K3's fused activations, else as is."""
    if fused:
        return lambda beta: jax.nn.sigmoid(beta.astype(_F32))
    return lambda beta: beta.astype(_F32)


def beta_values(beta: jax.Array, v: jax.Array, fused: bool) -> jax.Array:
    """``beta v`` in fp32 for rows of v [C, V] and their beta inputs [C] (logits when ``fused``):
    the right-hand side of ``U = X (beta v)``, in the W/U kernel and in the inter loop alike."""
    return beta_activation(fused)(beta)[:, None] * v.astype(_F32)
