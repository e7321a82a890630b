"""The KDA forward's inter-chunk stage as Pallas-Triton kernels: the serial walk over chunks.

Each program owns one (sequence, head, block of V columns) and keeps the fp32 state ``S [K, BV]``
on chip while it loops over its sequence's chunks (``states.sequence_chunks``: a batch row, or
one packed sequence's chunk range read in the kernel). Two forms:

* ``inter_fused``, one kernel: per chunk ``v_new = X (beta v - bk S)`` (which equals
  ``U - W S`` for ``W = X bk``, ``U = X beta v``: one more product on the serial path for no W/U
  kernel and its HBM round trip), ``o = Qg S + Aqk v_new``, ``S = gl * S + Kd^T v_new``; output
  and final state written directly.
* ``inter_two_pass``: the recurrence alone (``states.state_pass``, storing every chunk's state
  and ``v_new``), then ``o`` for all chunks in parallel: half the products in the serial loop,
  for an HBM round trip of the states. With few (sequence, head) pairs the serial loop is the
  critical path, so this form wins there (``gpu_config``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, dot
from pallas_kernels.kda.triton.intra_blocks import beta_values, matmul_dtypes
from pallas_kernels.kda.triton.states import sequence_chunks, state_pass

_F32 = jnp.float32


def _fused_kernel(*refs, n_chunks, bv, mm_dtype, varlen, fused):
    """Program (s, h, iv) runs the chunks of sequence s, so with ``varlen`` sequence s starts from
    its own initial state and never sees another sequence's chunks. ``fused``: beta comes as
    logits (K3's fused activations)."""
    refs, s, b, c_begin, c_end = sequence_chunks(refs, n_chunks, varlen)
    x_ref, bk_ref, v_ref, beta_ref, qg_ref, kd_ref, a_ref, gl_ref, h0_ref, o_ref, ht_ref = refs
    h, iv = pl.program_id(1), pl.program_id(2)
    vs = pl.ds(iv * bv, bv)

    def body(c, S):
        ts = pl.ds(c * C, C)
        bv_ = beta_values(beta_ref[b, ts, h], v_ref[b, ts, h, vs], fused)
        v_new = dot(x_ref[b, ts, h, :], bv_ - dot(bk_ref[b, ts, h, :], S, mm_dtype), mm_dtype)
        o = dot(qg_ref[b, ts, h, :], S, mm_dtype) + dot(a_ref[b, ts, h, :], v_new, mm_dtype)
        o_ref[b, ts, h, vs] = o.astype(o_ref.dtype)
        gl = gl_ref[b, c, h, :]
        return gl[:, None] * S + dot(kd_ref[b, ts, h, :], v_new, mm_dtype, trans_a=True)

    S = lax.fori_loop(c_begin, c_end, body, h0_ref[s, h, :, vs])
    ht_ref[s, h, :, vs] = S


def inter_fused(x, bk, v, beta, qg, kd, aqk, gl, h0, chunk_offsets, *, block_v, fused, interpret,
                params):
    """``(o in v's dtype, final state fp32 [S, H, K, V])`` from the intra stage's X, bk, Qg, Kd,
    Aqk, gl and the inputs v, beta (logits when ``fused``). ``chunk_offsets`` (int32 ``[S + 1]``)
    marks a chunk-aligned packed batch (B == 1) of S sequences; None: S = B."""
    B, Tp, H, K = bk.shape
    V = v.shape[-1]
    mm_dtype, _ = matmul_dtypes(v)
    varlen = chunk_offsets is not None
    n_seq = h0.shape[0]
    return pl.pallas_call(
        functools.partial(_fused_kernel, n_chunks=Tp // C, bv=block_v, mm_dtype=mm_dtype,
                          varlen=varlen, fused=fused),
        grid=(n_seq, H, V // block_v),
        out_shape=(
            jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype),
            jax.ShapeDtypeStruct((n_seq, H, K, V), _F32),
        ),
        interpret=interpret,
        name="kda_inter_state_varlen" if varlen else "kda_inter_state",
        **params,
    )(*((chunk_offsets,) if varlen else ()), x, bk, v, beta, qg, kd, aqk, gl, h0)


def _output_kernel(qg_ref, a_ref, hs_ref, vn_ref, o_ref, *, mm_dtype):
    """The two-pass stage's second kernel, parallel over chunks: ``o = Qg h + Aqk v_new`` from the
    chunk's stored input state ``h`` and ``v_new`` (both in the dtype that the fused kernel's
    products round them to, so the two forms give the same o)."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    o = dot(qg_ref[b, ts, h, :], hs_ref[b, c, h, :, :], mm_dtype) + dot(
        a_ref[b, ts, h, :], vn_ref[b, ts, h, :], mm_dtype)
    o_ref[b, ts, h, :] = o.astype(o_ref.dtype)


def inter_two_pass(w, u, qg, kd, aqk, gl, h0, chunk_offsets, *, block_v, out_dtype, interpret,
                   params):
    """``(o, final state)`` in two kernels: the state recurrence alone, which stores every chunk's
    input state, then ``_output_kernel`` over all chunks at once. Takes the W/U kernel's W, U."""
    mm_dtype, sd = matmul_dtypes(u)
    hs, vn, ht = state_pass(w, u, kd, gl, h0, chunk_offsets, block_v=block_v, mm_dtype=mm_dtype,
                            store_dtype=sd, interpret=interpret, params=params)
    B, Tp, H, _ = qg.shape
    o = pl.pallas_call(
        functools.partial(_output_kernel, mm_dtype=mm_dtype),
        grid=(B, H, Tp // C),
        out_shape=jax.ShapeDtypeStruct(u.shape, out_dtype),
        interpret=interpret,
        name="kda_output",
        **params,
    )(qg, aqk, hs, vn)
    return o, ht
