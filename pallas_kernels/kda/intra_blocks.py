"""Building blocks of the Pallas-Triton KDA intra-chunk kernels (forward and the backward's recompute).

Each helper works on one chunk of one head inside a kernel body, in 16-row sub-chunks, because
Pallas-Triton cannot slice register values: the kernels load sub-chunks straight from their refs
and pass Python lists of them here. Math: kda.md sections 2.1 / 2.4; the midpoint offsets are
explained in ``pallas_kda.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import BC, MID, NC, row
from pallas_kernels.kda.chunk_math import CLAMP as _CLAMP
from pallas_kernels.kda.chunk_math import dot as _dot

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


def matmul_dtypes(v: jax.Array) -> tuple[jnp.dtype, jnp.dtype]:
    """(matmul operand dtype, stored-intermediate dtype): IEEE fp32 throughout for fp32 inputs,
    else bf16 operands and intermediates in the input dtype (as fla)."""
    return (_F32, _F32) if v.dtype == _F32 else (jnp.bfloat16, v.dtype)


def unit_lower_inverse(L, precision=_F32):
    """X = (I + L)^{-1} from the 16x16 blocks L[i, j] (j <= i) of a strictly lower L, in fp32.

    Diagonal blocks: the exact Neumann product (I - L)(I + L^2)(I + L^4)(I + L^8) (L nilpotent of
    order 16); below them block forward substitution X_ij = -X_ii sum_{j<=m<i} L_im X_mj.
    ``precision``: the products' mode, IEEE fp32 (``jnp.float32``) or
    ``lax.DotAlgorithmPreset.BF16_BF16_F32_X3`` (three bf16 tensor-core products per fp32 one,
    ~1e-5 relative: for an X that is rounded to bf16 afterwards).
    """
    def _dot32(a, b):
        if precision == _F32:
            return _dot(a, b, _F32)
        return lax.dot(a, b, precision=precision, preferred_element_type=_F32)

    eye = jnp.eye(BC, dtype=_F32)
    X = {}
    for i in range(NC):
        Ld = L[i, i]
        P = eye - Ld
        Lp = _dot32(Ld, Ld)
        P = _dot32(P, eye + Lp)
        Lp = _dot32(Lp, Lp)
        P = _dot32(P, eye + Lp)
        Lp = _dot32(Lp, Lp)
        X[i, i] = _dot32(P, eye + Lp)
    for i in range(1, NC):
        for j in range(i):
            acc = _dot32(L[i, j], X[j, j])
            for m in range(j + 1, i):
                acc = acc + _dot32(L[i, m], X[m, j])
            X[i, j] = -_dot32(X[i, i], acc)
    return X


def activations(fused: bool, lower_bound: float, gs_ref, db_ref, h):
    """(gate, l2, beta) input activations of one head in fp32: K3's fused ones
    (``g = lb * sigmoid(exp(A_log) (g_raw + dt_bias))``, ``x rsqrt(sum x^2 + 1e-6)``, sigmoid),
    or identities on pre-activated inputs."""
    if not fused:
        f32 = lambda x: x.astype(_F32)  # noqa: E731
        return f32, f32, f32
    gate_scale = gs_ref[h, :].astype(_F32)[None, :]
    dt_bias = db_ref[h, :].astype(_F32)[None, :]

    def gate(g):
        return lower_bound * jax.nn.sigmoid(gate_scale * (g.astype(_F32) + dt_bias))

    def l2(x):
        x = x.astype(_F32)
        return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6)

    return gate, l2, lambda beta: jax.nn.sigmoid(beta.astype(_F32))


def cumulative_gate(g, carry, gate):
    """One sub-chunk's in-chunk cumulative log-decay, continuing from ``carry`` (the previous
    sub-chunk's last row). -> (G [BC, K], its last row)."""
    G = jnp.cumsum(gate(g), axis=0) + carry[None, :]
    rows = lax.broadcasted_iota(jnp.int32, G.shape, 0)
    return G, jnp.sum(jnp.where(rows == BC - 1, G, 0.0), axis=0)


def row_blocks(i, qs, beta, ks, Gs, mm_dtype):
    """Sub-chunk i's 16x16 blocks against sub-chunks j <= i (``ks``, ``Gs`` hold 0..i), with the
    midpoint offset ``G_m`` of row sub-chunk i: ``L[i, j] = beta_i (k_i e^{G_i-G_m})
    (k_j e^{G_m-G_j})^T`` and ``Aqk[i, j] = (qs_i e^{G_i-G_m}) (k_j e^{G_m-G_j})^T``, the diagonal
    blocks masked (strictly / non-strictly lower). -> ([L[i, j]], [Aqk[i, j]]) for j = 0..i."""
    ri = lax.broadcasted_iota(jnp.int32, (BC, BC), 0)
    ci = lax.broadcasted_iota(jnp.int32, (BC, BC), 1)
    G_m = row(Gs[i], MID)
    row_fac = jnp.exp(Gs[i] - G_m)
    kl = ks[i] * row_fac
    ql = qs * row_fac
    L_row, A_row = [], []
    for j in range(i + 1):
        kr = ks[j] * jnp.exp(jnp.minimum(G_m - Gs[j], _CLAMP))
        lk = _dot(kl, kr, mm_dtype, trans_b=True) * beta[:, None]
        aq = _dot(ql, kr, mm_dtype, trans_b=True)
        if i == j:
            lk = jnp.where(ri > ci, lk, 0.0)
            aq = jnp.where(ri >= ci, aq, 0.0)
        L_row.append(lk)
        A_row.append(aq)
    return L_row, A_row


def row_product(i, X, operands, mm_dtype):
    """Row block i of ``X @ operand`` from the operand's 16-row sub-chunks: the sum over j <= i,
    in order, of ``X[i, j] @ operands[j]``."""
    acc = _dot(X[i, 0], operands[0], mm_dtype)
    for j in range(1, i + 1):
        acc = acc + _dot(X[i, j], operands[j], mm_dtype)
    return acc


def store_row(ref, b, ts, h, blocks):
    """One 16-row block row of a [C, C] lower-block-triangular matrix: ``blocks`` for j <= i,
    zeros above."""
    for j in range(NC):
        blk = blocks[j] if j < len(blocks) else jnp.zeros((BC, BC), ref.dtype)
        ref[b, ts, h, pl.ds(j * BC, BC)] = blk.astype(ref.dtype)
