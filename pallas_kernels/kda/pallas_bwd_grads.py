"""Value side of the KDA backward's per-chunk gradient pass: ``value_kernel``.

Body for grid ``(B, H, N)``: each program loads one 64-token chunk, applies
``chunk_math.value_terms`` accumulated over V blocks, stores dv and writes the V sums to HBM for
``pallas_bwd_blocked.key_kernel_blocked``, the key side. (The whole-chunk "fused"/"split" and the
one-kernel "fused_blocked" variants were measured 2.2x / 16x slower on the H200 and removed; see
benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, value_terms

_F32 = jnp.float32


SUMS = ("dQg", "dW", "dKd", "dAqk", "dLU", "dgl", "dbeta")  # chunk_math.value_terms' sums


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


def _chunk_inputs(a_ref, w_ref, b_ref):
    """Program ids, then A and W (matmul operands only: kept in the stored dtype) and beta."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    return b, h, c, a_ref[b, ts, h, :], w_ref[b, ts, h, :], b_ref[b, ts, h].astype(_F32)


def value_kernel(v_ref, b_ref, a_ref, w_ref, u_ref, hs_ref, dhs_ref, do_ref, dvn_ref, dv_ref,
                 *sum_refs, mm_dtype, bv):
    """dv and the V sums to HBM (fp32; dW, only ever a matmul operand, in the operand dtype),
    so that the key side runs as a second kernel with its own, smaller live set."""
    b, h, c, A, W, beta = _chunk_inputs(a_ref, w_ref, b_ref)
    sums = _value_sums(b, h, c, A, W, beta, u_ref, v_ref, hs_ref, dhs_ref, do_ref, dvn_ref, dv_ref,
                       bv=bv, mm_dtype=mm_dtype)
    ts = pl.ds(c * C, C)
    for name, ref in zip(SUMS, sum_refs):
        if name == "dgl":
            ref[b, c, h, :] = jnp.sum(sums[name], axis=0)
        elif name == "dbeta":
            ref[b, ts, h] = sums[name]
        else:
            ref[b, ts, h, :] = sums[name].astype(ref.dtype)
