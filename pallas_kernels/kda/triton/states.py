"""The chunk-state recurrences of KDA as Pallas kernels (Triton lowering): the backward runs both,
the forward's two-pass inter stage the first.

Grid ``(S, H, V / BV)``, one program per (sequence, head, V block), sequential over the chunks with
the fp32 state ``[K, BV]`` on chip. V columns are independent in both recurrences, which is what
allows the V split.

``states_kernel``: the forward recurrence, storing every chunk's input state ``h``, ``v_new`` and
the final state: ``v_new = U - W S``, ``S <- gl * S + Kd^T v_new``.
``dstates_kernel``: the reverse recurrence, ``dv_new = Aqk^T dO + Kd dS``, store ``dh = dS`` (the
gradient of the state leaving the chunk), then ``dS <- gl * dS + Qg^T dO - W^T dv_new``; its last
value is the initial state's gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, dot

_F32 = jnp.float32


def sequence_chunks(refs: tuple, n_chunks: int, varlen: bool):
    """Program (s, h, iv) runs the chunks of sequence s: batch row s, chunks [0, n_chunks); or with
    ``varlen`` the packed row 0, chunks [cu[s], cu[s + 1]) read from the leading int32 ref."""
    s = pl.program_id(0)
    if varlen:
        cu_ref, *refs = refs
        return refs, s, 0, cu_ref[s], cu_ref[s + 1]
    return refs, s, s, 0, n_chunks


def states_kernel(*refs, n_chunks, bv, mm_dtype, varlen):
    refs, s, b, c0, c1 = sequence_chunks(refs, n_chunks, varlen)
    w_ref, u_ref, kd_ref, gl_ref, h0_ref, hs_ref, vn_ref, ht_ref = refs
    h, iv = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(iv * bv, bv)

    def body(c, S):
        ts = pl.ds(c * C, C)
        hs_ref[b, c, h, :, vs] = S.astype(hs_ref.dtype)
        v_new = u_ref[b, ts, h, vs].astype(_F32) - dot(w_ref[b, ts, h, :], S, mm_dtype)
        vn_ref[b, ts, h, vs] = v_new.astype(vn_ref.dtype)
        gl = gl_ref[b, c, h, :]
        return gl[:, None] * S + dot(kd_ref[b, ts, h, :], v_new, mm_dtype, trans_a=True)

    ht_ref[s, h, :, vs] = lax.fori_loop(c0, c1, body, h0_ref[s, h, :, vs])


def state_pass(W, U, kd, gl, h0, chunk_offsets, *, block_v, mm_dtype, store_dtype, interpret,
               params):
    """``(h [B, N, H, K, V] in store_dtype, v_new [B, Tp, H, V] in store_dtype, final state fp32
    [S, H, K, V])`` by ``states_kernel``. ``chunk_offsets`` (int32 ``[S + 1]``) marks a
    chunk-aligned packed batch (B == 1) of S sequences with states ``h0[s]``; None: S = B."""
    B, Tp, H, K = W.shape
    V, n = U.shape[-1], Tp // C
    varlen = chunk_offsets is not None
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(states_kernel, n_chunks=n, bv=block_v, mm_dtype=mm_dtype,
                          varlen=varlen),
        grid=(h0.shape[0], H, V // block_v),
        out_shape=(sds((B, n, H, K, V), store_dtype), sds((B, Tp, H, V), store_dtype),
                   sds(h0.shape, _F32)),
        interpret=interpret, name="kda_states", **params,
    )(*((chunk_offsets,) if varlen else ()), W, U, kd, gl, h0)


def dstates_kernel(*refs, n_chunks, bv, mm_dtype, varlen):
    refs, s, b, c0, c1 = sequence_chunks(refs, n_chunks, varlen)
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
