"""Analytic backward of the safe-gate chunked KDA as Pallas kernels (Triton lowering on GPU).

The same three passes as ``chunk_backward.py`` (whose per-chunk algebra, ``chunk_math.py``, the
gradient kernel calls on whole 64-token tiles), as five ``pl.pallas_call``s:

1. ``stage_parts``, grid ``(B, H, N)``, parallel: recompute the chunk's A = (I + L)^{-1}, W, U,
   Aqk, Qg, Kd and decay gl from q, k, v, g, beta with the forward's own intra kernels.
2. ``_states_kernel``, grid ``(B, H, V / BV)``: the forward state recurrence again with the fp32
   state ``[K, BV]`` on chip, storing every chunk's input state ``h``.
3. ``_dstates_kernel``, grid ``(B, H, V / BV)``: the reverse recurrence with ``dS`` on chip:
   ``dv_new = Aqk^T dO + Kd dS``, store ``dh = dS``, then
   ``dS <- gl * dS + Qg^T dO - W^T dv_new``; its last value is the initial state's gradient.
   V columns are independent in both recurrences, which is what allows the V split.
4. ``_grads_kernel``, grid ``(B, H, N)``, parallel: dq, dk, dv, dg, dbeta of the chunk; or with
   ``grads="split"`` ``_value_kernel`` (dv and the V-contracting sums, fp32 to HBM) then
   ``_key_kernel`` (the rest), two smaller live sets for one more HBM round trip; ``"blocked"``
   takes the key side in 16-row blocks (``pallas_bwd_blocked.py``), ~5x fewer multiply-adds.

Packed sequences (``cu_seqlens``) run on the forward's chunk-aligned layout
(``varlen_layout.py``); the two recurrences then loop over one sequence's chunk range per program,
from and into that sequence's state, and the per-chunk passes run unchanged.

Nothing comes from the forward pass: residuals are the inputs, everything else is recomputed.
Intermediates are stored in the input dtype (bf16 in training, like fla's backward), states and
accumulation in fp32; fp32 inputs keep everything fp32 with IEEE matmuls (what the tests use).
Requires the safe gate, ``g >= -5`` (see ``chunk_math.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, dot, key_grads, value_terms
from pallas_kernels.kda.pallas_bwd_blocked import key_kernel_blocked
from pallas_kernels.kda.pallas_kda import _intra_solve_kernel, _intra_wu_kernel
from pallas_kernels.kda.reference import host_offsets
from pallas_kernels.kda.varlen_layout import chunk_layout, from_aligned, to_aligned

try:  # Triton compiler params (GPU only); interpret mode ignores them.
    from jax.experimental.pallas import triton as pl_triton
except ImportError:  # pragma: no cover
    pl_triton = None

_F32 = jnp.float32


def _sequence(refs: tuple, n_chunks: int, varlen: bool):
    """Program (s, h, iv) runs the chunks of sequence s: batch row s, chunks [0, n_chunks); or with
    ``varlen`` the packed row 0, chunks [cu[s], cu[s + 1]) read from the leading int32 ref."""
    s = pl.program_id(0)
    if varlen:
        cu_ref, *refs = refs
        return refs, s, 0, cu_ref[s], cu_ref[s + 1]
    return refs, s, s, 0, n_chunks


def _states_kernel(*refs, n_chunks, bv, mm_dtype, varlen):
    refs, s, b, c0, c1 = _sequence(refs, n_chunks, varlen)
    w_ref, u_ref, kd_ref, gl_ref, h0_ref, hs_ref = refs
    h, iv = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(iv * bv, bv)

    def body(c, S):
        ts = pl.ds(c * C, C)
        hs_ref[b, c, h, :, vs] = S.astype(hs_ref.dtype)
        v_new = u_ref[b, ts, h, vs].astype(_F32) - dot(w_ref[b, ts, h, :], S, mm_dtype)
        gl = gl_ref[b, c, h, :]
        return gl[:, None] * S + dot(kd_ref[b, ts, h, :], v_new, mm_dtype, trans_a=True)

    lax.fori_loop(c0, c1, body, h0_ref[s, h, :, vs])


def _dstates_kernel(*refs, n_chunks, bv, mm_dtype, varlen):
    refs, s, b, c0, c1 = _sequence(refs, n_chunks, varlen)
    qg_ref, w_ref, aqk_ref, kd_ref, gl_ref, do_ref, dht_ref, dhs_ref, dvn_ref, ds0_ref = refs
    h, iv = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(iv * bv, bv)

    def body(i, dS):
        c = c0 + c1 - 1 - i  # chunks in reverse
        ts = pl.ds(c * C, C)
        do = do_ref[b, ts, h, vs]
        dvn = dot(aqk_ref[b, ts, h, :], do, mm_dtype, trans_a=True) + dot(
            kd_ref[b, ts, h, :], dS, mm_dtype)
        dhs_ref[b, c, h, :, vs] = dS.astype(dhs_ref.dtype)
        dvn_ref[b, ts, h, vs] = dvn.astype(dvn_ref.dtype)
        gl = gl_ref[b, c, h, :]
        return (gl[:, None] * dS + dot(qg_ref[b, ts, h, :], do, mm_dtype, trans_a=True)
                - dot(w_ref[b, ts, h, :], dvn, mm_dtype, trans_a=True))

    ds0_ref[s, h, :, vs] = lax.fori_loop(c0, c1, body, dht_ref[s, h, :, vs])


_SUMS = ("dQg", "dW", "dKd", "dAqk", "dLU", "dgl", "dbeta")  # chunk_math.value_terms' sums


def _value_sums(b, h, c, A, W, beta, u_ref, v_ref, hs_ref, dhs_ref, do_ref, dvn_ref, dv_ref, *,
                bv, mm_dtype) -> dict:
    """The V-contracting terms, accumulated over V blocks of ``bv`` columns so that only
    ``[K, bv]`` slices of the two states are live at a time; stores dv on the way."""
    ts = pl.ds(c * C, C)
    K, V = hs_ref.shape[-2:]

    def body(iv, acc):
        vs = pl.ds(iv * bv, bv)
        ld = lambda ref: ref[b, ts, h, vs].astype(_F32)  # noqa: E731
        sums, dv = value_terms(A, W, ld(u_ref), ld(v_ref), hs_ref[b, c, h, :, vs].astype(_F32),
                               dhs_ref[b, c, h, :, vs].astype(_F32), ld(do_ref), ld(dvn_ref), beta,
                               mm_dtype)
        dv_ref[b, ts, h, vs] = dv.astype(dv_ref.dtype)
        return {n: acc[n] + sums[n] for n in acc}

    z = lambda *s: jnp.zeros(s, _F32)  # noqa: E731
    init = dict(dQg=z(C, K), dW=z(C, K), dKd=z(C, K), dAqk=z(C, C), dLU=z(C, C), dgl=z(1, K),
                dbeta=z(C))
    return lax.fori_loop(0, V // bv, body, init)


def _store_key_grads(b, h, c, A, W, beta, sums, q_ref, k_ref, g_ref, dq_ref, dk_ref, dg_ref,
                     db_ref, *, scale, mm_dtype) -> None:
    ts = pl.ds(c * C, C)
    dqs, dk, dg, dbeta = key_grads(q_ref[b, ts, h, :].astype(_F32) * scale,
                                   k_ref[b, ts, h, :].astype(_F32), g_ref[b, ts, h, :].astype(_F32),
                                   beta, A, W, sums, mm_dtype)
    dq_ref[b, ts, h, :] = (dqs * scale).astype(dq_ref.dtype)
    dk_ref[b, ts, h, :] = dk.astype(dk_ref.dtype)
    dg_ref[b, ts, h, :] = dg.astype(dg_ref.dtype)
    db_ref[b, ts, h] = dbeta.astype(db_ref.dtype)


def _chunk_inputs(a_ref, w_ref, b_ref):
    """Program ids, then A and W (matmul operands only: kept in the stored dtype) and beta."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    return b, h, c, a_ref[b, ts, h, :], w_ref[b, ts, h, :], b_ref[b, ts, h].astype(_F32)


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, w_ref, u_ref, hs_ref, dhs_ref, do_ref,
                  dvn_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, *, scale, mm_dtype, bv):
    """One chunk's gradients in one kernel (``grads="fused"``)."""
    b, h, c, A, W, beta = _chunk_inputs(a_ref, w_ref, b_ref)
    sums = _value_sums(b, h, c, A, W, beta, u_ref, v_ref, hs_ref, dhs_ref, do_ref, dvn_ref, dv_ref,
                       bv=bv, mm_dtype=mm_dtype)
    _store_key_grads(b, h, c, A, W, beta, sums, q_ref, k_ref, g_ref, dq_ref, dk_ref, dg_ref,
                     db_ref, scale=scale, mm_dtype=mm_dtype)


def _value_kernel(v_ref, b_ref, a_ref, w_ref, u_ref, hs_ref, dhs_ref, do_ref, dvn_ref, dv_ref,
                  *sum_refs, mm_dtype, bv):
    """First half of ``grads="split"`` / ``"blocked"``: dv and the V sums (fp32, to HBM)."""
    b, h, c, A, W, beta = _chunk_inputs(a_ref, w_ref, b_ref)
    sums = _value_sums(b, h, c, A, W, beta, u_ref, v_ref, hs_ref, dhs_ref, do_ref, dvn_ref, dv_ref,
                       bv=bv, mm_dtype=mm_dtype)
    ts = pl.ds(c * C, C)
    for name, ref in zip(_SUMS, sum_refs):
        if name == "dgl":
            ref[b, c, h, :] = jnp.sum(sums[name], axis=0)
        elif name == "dbeta":
            ref[b, ts, h] = sums[name]
        else:
            ref[b, ts, h, :] = sums[name]


def _key_kernel(q_ref, k_ref, g_ref, b_ref, a_ref, w_ref, *refs, scale, mm_dtype):
    """Second half of ``grads="split"``: dq, dk, dg, dbeta from the stored V sums."""
    *sum_refs, dq_ref, dk_ref, dg_ref, db_ref = refs
    b, h, c, A, W, beta = _chunk_inputs(a_ref, w_ref, b_ref)
    ts = pl.ds(c * C, C)
    sums = {}
    for name, ref in zip(_SUMS, sum_refs):
        if name == "dgl":
            sums[name] = ref[b, c, h, :][None, :]
        elif name == "dbeta":
            sums[name] = ref[b, ts, h]
        else:
            sums[name] = ref[b, ts, h, :]
    _store_key_grads(b, h, c, A, W, beta, sums, q_ref, k_ref, g_ref, dq_ref, dk_ref, dg_ref,
                     db_ref, scale=scale, mm_dtype=mm_dtype)


def _params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    if interpret or pl_triton is None:
        return {}
    return dict(compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages))


def _dtypes(v: jax.Array):
    """(matmul operand dtype, stored-intermediate dtype)."""
    return (_F32, _F32) if v.dtype == _F32 else (jnp.bfloat16, v.dtype)


_TUNING = ("interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=("scale",) + _TUNING)
def stage_parts(q, k, v, g, beta, *, scale, interpret, num_warps, num_stages):
    """Pass 1: ``(A, W, U, Aqk, Qg, Kd, gl)`` of every chunk.

    The forward's own intra stage (``pallas_kda``'s ``intra="split"`` kernels: 16-row sub-chunks,
    block inverse), so W, U, Aqk, Qg, Kd are the forward's values bit for bit; A is the
    ``(I + L)^{-1}`` that its first kernel already writes.
    """
    B, Tp, H, K = q.shape  # Tp: a multiple of C (padded by the caller)
    V, n = v.shape[-1], Tp // C
    mm_dtype, sd = _dtypes(v)
    sds = jax.ShapeDtypeStruct
    params = _params(interpret, num_warps, num_stages)
    A, bk, qg, kd, aqk, gl = pl.pallas_call(
        functools.partial(_intra_solve_kernel, scale=scale, mm_dtype=mm_dtype, fused=False,
                          lower_bound=0.0),
        grid=(B, H, n),
        out_shape=(sds((B, Tp, H, C), sd), sds((B, Tp, H, K), sd), sds((B, Tp, H, K), sd),
                   sds((B, Tp, H, K), sd), sds((B, Tp, H, C), sd), sds((B, n, H, K), _F32)),
        interpret=interpret, name="kda_bwd_intra_solve", **params,
    )(q, k, g, beta)
    W, U = pl.pallas_call(
        functools.partial(_intra_wu_kernel, mm_dtype=mm_dtype, fused=False),
        grid=(B, H, n),
        out_shape=(sds((B, Tp, H, K), sd), sds((B, Tp, H, V), sd)),
        interpret=interpret, name="kda_bwd_intra_wu", **params,
    )(A, bk, v, beta)
    return A, W, U, aqk, qg, kd, gl


@functools.partial(jax.jit, static_argnames=("block_v",) + _TUNING)
def stage_states(W, U, kd, gl, h0, chunk_offsets=None, *, block_v, interpret, num_warps,
                 num_stages):
    """Pass 2a: every chunk's input state ``[B, N, H, K, V]``. ``chunk_offsets`` (int32
    ``[S + 1]``) marks a chunk-aligned packed batch (B == 1) of S sequences with states h0[s]."""
    B, Tp, H, K = W.shape
    V, n = U.shape[-1], Tp // C
    mm_dtype, sd = _dtypes(U)
    varlen = chunk_offsets is not None
    return pl.pallas_call(
        functools.partial(_states_kernel, n_chunks=n, bv=block_v, mm_dtype=mm_dtype,
                          varlen=varlen),
        grid=(h0.shape[0], H, V // block_v),
        out_shape=jax.ShapeDtypeStruct((B, n, H, K, V), sd),
        interpret=interpret, name="kda_bwd_states", **_params(interpret, num_warps, num_stages),
    )(*((chunk_offsets,) if varlen else ()), W, U, kd, gl, h0)


@functools.partial(jax.jit, static_argnames=("block_v",) + _TUNING)
def stage_dstates(qg, W, aqk, kd, gl, do, dht, chunk_offsets=None, *, block_v, interpret,
                  num_warps, num_stages):
    """Pass 2b: ``(dh [B, N, H, K, V], dv_new [B, Tp, H, V], d initial_state)``."""
    B, Tp, H, K = W.shape
    V, n = do.shape[-1], Tp // C
    mm_dtype, sd = _dtypes(do)
    sds = jax.ShapeDtypeStruct
    varlen = chunk_offsets is not None
    return pl.pallas_call(
        functools.partial(_dstates_kernel, n_chunks=n, bv=block_v, mm_dtype=mm_dtype,
                          varlen=varlen),
        grid=(dht.shape[0], H, V // block_v),
        out_shape=(sds((B, n, H, K, V), sd), sds((B, Tp, H, V), sd), sds(dht.shape, _F32)),
        interpret=interpret, name="kda_bwd_dstates", **_params(interpret, num_warps, num_stages),
    )(*((chunk_offsets,) if varlen else ()), qg, W, aqk, kd, gl, do, dht)


GRADS_VARIANTS = ("fused", "split", "blocked")


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "variant") + _TUNING)
def stage_grads(q, k, v, g, beta, A, W, U, hs, dhs, do, dvn, *, scale, block_v, variant,
                interpret, num_warps, num_stages):
    """Pass 3: ``(dq, dk, dv, dg, dbeta)`` in the inputs' dtypes. ``variant``: "fused" (one
    kernel), "split" (V sums through HBM in fp32, then the whole-chunk key side) or "blocked"
    (V sums through HBM, then ``pallas_bwd_blocked``'s sub-chunk-blocked key side)."""
    B, Tp, H, K = q.shape
    n = Tp // C
    mm_dtype, _ = _dtypes(v)
    sds = jax.ShapeDtypeStruct
    params = _params(interpret, num_warps, num_stages)
    key_out = (sds(q.shape, q.dtype), sds(k.shape, k.dtype), sds(g.shape, g.dtype),
               sds(beta.shape, beta.dtype))
    if variant == "fused":
        dq, dk, dv, dg, db = pl.pallas_call(
            functools.partial(_grads_kernel, scale=scale, mm_dtype=mm_dtype, bv=block_v),
            grid=(B, H, n),
            out_shape=key_out[:2] + (sds(v.shape, v.dtype),) + key_out[2:],
            interpret=interpret, name="kda_bwd_grads", **params,
        )(q, k, v, g, beta, A, W, U, hs, dhs, do, dvn)
        return dq, dk, dv, dg, db
    ck, cc = sds((B, Tp, H, K), _F32), sds((B, Tp, H, C), _F32)
    dv, *sums = pl.pallas_call(
        functools.partial(_value_kernel, mm_dtype=mm_dtype, bv=block_v),
        grid=(B, H, n),
        out_shape=(sds(v.shape, v.dtype), ck, ck, ck, cc, cc, sds((B, n, H, K), _F32),
                   sds(beta.shape, _F32)),
        interpret=interpret, name="kda_bwd_grads_v", **params,
    )(v, beta, A, W, U, hs, dhs, do, dvn)
    key = _key_kernel if variant == "split" else key_kernel_blocked
    dq, dk, dg, db = pl.pallas_call(
        functools.partial(key, scale=scale, mm_dtype=mm_dtype),
        grid=(B, H, n),
        out_shape=key_out,
        interpret=interpret, name=f"kda_bwd_grads_k_{variant}", **params,
    )(q, k, g, beta, A, W, *sums)
    return dq, dk, dv, dg, db


@functools.partial(jax.jit,
                   static_argnames=("scale", "block_v", "grads_block_v", "grads") + _TUNING)
def _bwd(q, k, v, g, beta, h0, do, dht, chunk_offsets, *, scale, block_v, grads_block_v, grads,
         **tuning):
    A, W, U, aqk, qg, kd, gl = stage_parts(q, k, v, g, beta, scale=scale, **tuning)
    hs = stage_states(W, U, kd, gl, h0, chunk_offsets, block_v=block_v, **tuning)
    dhs, dvn, ds0 = stage_dstates(qg, W, aqk, kd, gl, do, dht, chunk_offsets, block_v=block_v,
                                  **tuning)
    out = stage_grads(q, k, v, g, beta, A, W, U, hs, dhs, do, dvn, scale=scale,
                      block_v=grads_block_v, variant=grads, **tuning)
    return (*out, ds0)


def pallas_chunk_kda_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    do: jax.Array,
    dht: jax.Array,
    *,
    scale: float,
    cu_seqlens: object | None = None,
    interpret: bool | None = None,
    block_v: int = 64,
    grads_block_v: int = 32,
    grads: str = "fused",
    num_warps: int = 4,
    num_stages: int = 1,
) -> tuple[jax.Array, ...]:
    """Gradients of ``pallas_chunk_kda``'s ``(o, final_state)`` (safe gate, fla conventions).

    q, k, g [B, T, H, K]; v, do [B, T, H, V]; beta [B, T, H]; initial_state, dht fp32
    [B, H, K, V] (with ``cu_seqlens``, host offsets [N + 1] of packed sequences and B == 1:
    [N, H, K, V]). Returns ``(dq, dk, dv, dg, dbeta, d initial_state)`` in the inputs' dtypes
    (the state gradient fp32). ``interpret`` defaults to True off GPU. ``block_v``: V columns per
    program of the two state recurrences; ``grads_block_v``: V columns per step of the gradient
    kernel's loop (its live set); ``grads`` picks the gradient pass's kernels (see ``stage_grads``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        bad = [f"{n}={d}" for n, d in (("K", K), ("V", V)) if d < 16 or d & (d - 1)]
        if bad:
            raise ValueError(
                f"pallas KDA backward on GPU needs K and V powers of two >= 16 (Triton), got {bad}")
    if grads not in GRADS_VARIANTS:
        raise ValueError(f"grads: expected one of {GRADS_VARIANTS}, got {grads!r}")
    blocks = {}
    for name, size in (("block_v", block_v), ("grads_block_v", grads_block_v)):
        blocks[name] = min(size, V)
        if V % blocks[name]:
            raise ValueError(f"{name}: V={V} is not a multiple of {name}={blocks[name]}")
    n_states = B
    if cu_seqlens is not None:  # packed sequences: run on the chunk-aligned layout
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got q shape {q.shape}")
        layout = chunk_layout(host_offsets(cu_seqlens, T), C)
        n_states = layout.chunk_offsets.size - 1
        q, k, v, g, beta, do = (to_aligned(x, layout) for x in (q, k, v, g, beta, do))
        offsets = jnp.asarray(layout.chunk_offsets)
    else:
        Tp = -(-T // C) * C  # identity steps (k = v = beta = g = 0), zero output cotangent
        if Tp != T:
            pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
            q, k, v, g, beta, do = (pad(x) for x in (q, k, v, g, beta, do))
        offsets = None
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        if tuple(x.shape) != (n_states, H, K, V):
            raise ValueError(f"{name}: expected shape {(n_states, H, K, V)}, got {tuple(x.shape)}")
    dq, dk, dv, dg, db, ds0 = _bwd(
        q, k, v, g, beta, initial_state.astype(_F32), do.astype(v.dtype), dht.astype(_F32),
        offsets, scale=float(scale), interpret=bool(interpret), num_warps=num_warps,
        num_stages=num_stages, grads=grads, **blocks,
    )
    out = (dq, dk, dv, dg, db)
    if cu_seqlens is not None:
        out = tuple(from_aligned(x, layout) for x in out)
    elif dq.shape[1] != T:
        out = tuple(x[:, :T] for x in out)
    return (*out, ds0)


__all__ = ["pallas_chunk_kda_bwd"]
