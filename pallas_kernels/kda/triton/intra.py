"""The KDA forward's intra-chunk stage as Pallas-Triton kernels, on whole 64-row chunks.

1. ``intra_pairs`` (``_pairs_kernel``), grid ``(B, H, N)``: input activations, the cumulative
   gate ``G`` of the whole chunk, ``Qg``, ``Kd``, ``bk = beta k e^G``, ``gl = e^{G_last}``, and
   the pair matrices ``L = beta_r P(k, k)`` (strict, fp32) and ``Aqk = P(q, k)`` (causal) from
   ``chunk_math.pair_scores_many`` (row factors from each row's sub-chunk midpoint, one column
   factor per sub-chunk: [64, K] x [K, 64] products masked by row block). Where the Mosaic GPU
   pair kernel fits (``gpu_config``) it replaces this one.
2. ``chunk_inverses``: ``X = (I + L)^{-1}`` by 16x16 blocks (``intra_blocks.unit_lower_inverse``)
   from the stored ``L``, on one warp.
3. ``intra_wu``: ``W = X bk``, ``U = X (beta v)``, for the two-pass inter stage (the fused and
   segmented ones form them in their own loops).

The backward, when the forward kept X and Aqk, needs only the gate terms and W, U again:
``intra_from_inverse``, one kernel without pair products or inverse.

Why this shape: a single kernel over 16-row sub-chunks put many small products through
shared-memory layout changes and barriers, and at 8 warps every 16x16 tile was held and computed
by several warps at once; it was measured slower than this stage and the inter kernel together
(benchmarks/RESULTS.md). Here the pair and W/U kernels only make 64-row products, 4x more
tensor-core work than the 16x16 blocks need but far fewer instructions, and the one part that
needs 16x16 blocks, the triangular inverse, runs alone on one warp, where a tile is neither
replicated nor synchronised across warps. The price is an HBM round trip of ``L`` (fp32), ``X``
and ``bk``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import (
    BC, BF16X3, C, NC, causal_masks, dot, pair_output_types, pair_scores_many, row,
)
from pallas_kernels.kda.triton.intra_blocks import (
    activations, approx_math, beta_values, gate_exp, matmul_dtypes, unit_lower_inverse,
)

_F32 = jnp.float32


def _chunk_gates(q_ref, k_ref, g_ref, b_ref, qg_ref, kd_ref, gl_ref, bk_ref, *, scale, gate, l2,
                 beta_of, exp):
    """The chunk's gate terms: writes ``gl = e^{G_last}``, ``Kd``, ``Qg`` (and ``bk = beta k e^G``
    when ``bk_ref`` is given) and returns ``(G, k, qs, beta [C, 1], bk)`` in fp32, G the
    cumulative gate in ``exp``'s unit. The pair kernel and ``_saved_parts_kernel`` share it, so
    the backward's W, U, Qg, Kd, gl are the forward's bit for bit."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    sd = qg_ref.dtype
    G = jnp.cumsum(gate(g_ref[b, ts, h, :]), axis=0)
    # G_last is G's own last row, so the last row of Kd = k e^{G_last - G} is exactly k.
    G_last = row(G, C - 1)
    gl_ref[b, pl.ds(c, 1), h, :] = exp(G_last)
    eg = exp(G)
    k = l2(k_ref[b, ts, h, :])
    beta = beta_of(b_ref[b, ts, h])[:, None]
    kd_ref[b, ts, h, :] = (k * exp(G_last - G)).astype(sd)
    bk = beta * k * eg
    if bk_ref is not None:
        bk_ref[b, ts, h, :] = bk.astype(sd)
    qs = l2(q_ref[b, ts, h, :]) * scale
    qg_ref[b, ts, h, :] = (qs * eg).astype(sd)
    return G, k, qs, beta, bk


def _pairs_kernel(q_ref, k_ref, g_ref, b_ref, *rest, scale, mm_dtype, fused, lower_bound,
                  approx):
    gs_ref, db_ref, rest = (*rest[:2], rest[2:]) if fused else (None, None, rest)
    l_ref, bk_ref, qg_ref, kd_ref, a_ref, gl_ref = rest
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    # with ``approx`` G is in units of ln 2 and ``exp`` is the hardware exp2 (``gate_exp``)
    unit, exp = gate_exp(approx)
    gate, l2, beta_of = activations(fused, lower_bound, gs_ref, db_ref, h, approx)
    G, k, qs, beta, _ = _chunk_gates(q_ref, k_ref, g_ref, b_ref, qg_ref, kd_ref, gl_ref, bk_ref,
                                     scale=scale, gate=gate, l2=l2, beta_of=beta_of, exp=exp)

    causal, strict = causal_masks()
    p_kk, p_qk = pair_scores_many((k, qs), k, G, mm_dtype, unit, exp)
    l_ref[b, ts, h, :] = jnp.where(strict, beta * p_kk, 0.0)
    a_ref[b, ts, h, :] = jnp.where(causal, p_qk, 0.0).astype(a_ref.dtype)


def _saved_parts_kernel(x_ref, q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, qg_ref, kd_ref,
                        gl_ref, *, scale, mm_dtype, approx):
    """The pair kernel's gate terms and the W/U kernel's products from a stored ``X``: what the
    backward needs of the intra stage when the forward kept X and Aqk (pre-activated inputs)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    gate, l2, beta_of = activations(False, 0.0, None, None, h, approx)
    _, _, _, beta, bk = _chunk_gates(q_ref, k_ref, g_ref, b_ref, qg_ref, kd_ref, gl_ref, None,
                                     scale=scale, gate=gate, l2=l2, beta_of=beta_of,
                                     exp=gate_exp(approx)[1])
    X = x_ref[b, ts, h, :]
    sd = w_ref.dtype  # bk rounded as the W/U kernel reads it from the pair kernel's output
    w_ref[b, ts, h, :] = dot(X, bk.astype(sd), mm_dtype).astype(sd)
    bv = beta * v_ref[b, ts, h, :].astype(_F32)
    u_ref[b, ts, h, :] = dot(X, bv, mm_dtype).astype(u_ref.dtype)


def _inverse_kernel(l_ref, x_ref, *, mm_dtype):
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0 = c * C
    block = lambda i, j: (b, pl.ds(t0 + i * BC, BC), h, pl.ds(j * BC, BC))  # noqa: E731

    def put(i, j, x):
        x_ref[block(i, j)] = x.astype(x_ref.dtype)

    unit_lower_inverse(lambda i, j: l_ref[block(i, j)], put, mm_dtype)
    zeros = jnp.zeros((BC, BC), x_ref.dtype)
    for i in range(NC):
        for j in range(i + 1, NC):
            x_ref[block(i, j)] = zeros


def _wu_kernel(x_ref, bk_ref, v_ref, b_ref, w_ref, u_ref, *, mm_dtype, fused):
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    X = x_ref[b, ts, h, :]
    w_ref[b, ts, h, :] = dot(X, bk_ref[b, ts, h, :], mm_dtype).astype(w_ref.dtype)
    bv = beta_values(b_ref[b, ts, h], v_ref[b, ts, h, :], fused)
    u_ref[b, ts, h, :] = dot(X, bv, mm_dtype).astype(u_ref.dtype)


def intra_pairs(ins, *, scale, fused, lower_bound, interpret, params):
    """``(L fp32, bk, Qg, Kd, Aqk, gl)`` of every chunk (``_pairs_kernel``). ``ins``: q, k, v, g,
    beta [, gate_scale, dt_bias when ``fused``]."""
    q, k, v, g, beta = ins[:5]
    B, Tp, H, _ = q.shape
    mm_dtype, sd = matmul_dtypes(v)
    return pl.pallas_call(
        functools.partial(_pairs_kernel, scale=scale, mm_dtype=mm_dtype, fused=fused,
                          lower_bound=lower_bound, approx=approx_math(interpret, mm_dtype)),
        grid=(B, H, Tp // C),
        out_shape=pair_output_types(q, sd),
        interpret=interpret,
        name="kda_intra_pairs",
        **params,
    )(q, k, g, beta, *ins[5:])


def chunk_inverses(L, dtype, *, interpret, params, mm_dtype=None):
    """``X = (I + L)^{-1}`` of every chunk's strictly lower ``L`` [B, Tp, H, C], stored in
    ``dtype`` (``_inverse_kernel``). ``mm_dtype``: the ``chunk_math.dot`` mode of its 16x16
    products; by default IEEE fp32 for an fp32 X and ``BF16X3`` (three bf16 tensor-core
    products each) for a bf16 one."""
    B, Tp, H, _ = L.shape
    if mm_dtype is None:
        mm_dtype = _F32 if dtype == _F32 else BF16X3
    return pl.pallas_call(
        functools.partial(_inverse_kernel, mm_dtype=mm_dtype),
        grid=(B, H, Tp // C),
        out_shape=jax.ShapeDtypeStruct(L.shape, dtype),
        interpret=interpret,
        name="kda_intra_inverse",
        **params,
    )(L)


def intra_wu(x, bk, v, beta, *, fused, interpret, params):
    """``(W, U) = (X bk, X (beta v))`` per whole chunk; ``beta`` holds logits when ``fused``."""
    B, Tp, H, K = bk.shape
    mm_dtype, sd = matmul_dtypes(v)
    return pl.pallas_call(
        functools.partial(_wu_kernel, mm_dtype=mm_dtype, fused=fused),
        grid=(B, H, Tp // C),
        out_shape=(
            jax.ShapeDtypeStruct((B, Tp, H, K), sd),
            jax.ShapeDtypeStruct((B, Tp, H, v.shape[-1]), sd),
        ),
        interpret=interpret,
        name="kda_intra_wu",
        **params,
    )(x, bk, v, beta)


def intra_from_inverse(x, ins, *, scale, interpret, params):
    """``(W, U, Qg, Kd, gl)`` of every chunk from its stored ``X`` (``_saved_parts_kernel``): the
    intra stage without its pair products and inverse, equal to the Triton intra stage's outputs
    bit for bit. ``ins``: pre-activated q, k, v, g, beta."""
    q, k, v, g, beta = ins
    B, Tp, H, K = q.shape
    n = Tp // C
    mm_dtype, sd = matmul_dtypes(v)
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_saved_parts_kernel, scale=scale, mm_dtype=mm_dtype,
                          approx=approx_math(interpret, mm_dtype)),
        grid=(B, H, n),
        out_shape=(
            sds((B, Tp, H, K), sd),  # W
            sds((B, Tp, H, v.shape[-1]), sd),  # U
            sds((B, Tp, H, K), sd),  # Qg
            sds((B, Tp, H, K), sd),  # Kd
            sds((B, n, H, K), _F32),  # e^{G_last}
        ),
        interpret=interpret,
        name="kda_intra_saved_parts",
        **params,
    )(x, q, k, v, g, beta)
