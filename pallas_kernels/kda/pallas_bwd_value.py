"""The V-contracting sums of the KDA backward's gradient pass, as two Pallas kernel bodies.

Per chunk (math: ``chunk_math.value_terms``), with ``h``/``dh`` the chunk's state and state
gradient ``[K, V]`` and ``v_new = U - W h`` (stored by the state recurrence, which forms it anyway):

- key-side sums, one ``[C, bk]`` column block of key channels per program, grid
  ``(B, H, N, K / bk)``: ``dQg = dO h^T``, ``dW = -dv_new h^T``, ``dKd = v_new dh^T`` and
  ``dgl = sum_V h * dh``. Each contracts only over V, so the key channels split across programs
  with no reduction between them: four times the programs of one whole-chunk kernel, each holding
  a quarter of the fp32 accumulators (a whole-chunk kernel holds three ``[64, 128]`` fp32 sums:
  255 registers per thread, one program per SM on an H200; this one needs 64 at 32 channels).
- chunk sums, grid ``(B, H, N)``: ``yu = A^T dv_new`` (the gradient of ``beta v``), ``dv = beta yu``,
  ``dAqk = dO v_new^T``, ``dL = -yu v_new^T`` and ``dbeta = sum_V yu * v``.

Outputs go to HBM in fp32 (dW, only ever a matmul operand, in the operand dtype) for the blocked
key-side kernel (``pallas_bwd_blocked.py``); the channel key side (``pallas_bwd_channels.py``)
forms its key-channel sums itself and reads only the chunk sums. Measured on an H200 at B4
T8192 H96, the key-channel sums plus the blocked key side took 39.1 ms against 43.6 for one
program per chunk that looped over V blocks with all the sums live (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, dot

_F32 = jnp.float32


def key_sums_kernel(hs_ref, dhs_ref, do_ref, dvn_ref, vn_ref, dqg_ref, dw_ref, dkd_ref, dgl_ref,
                    *, mm_dtype, bk):
    b, h, c, kb = (pl.program_id(i) for i in range(4))
    ts, ks = pl.ds(c * C, C), pl.ds(kb * bk, bk)
    hk = hs_ref[b, c, h, ks, :]  # [bk, V]
    dhk = dhs_ref[b, c, h, ks, :]
    dqg_ref[b, ts, h, ks] = dot(do_ref[b, ts, h, :], hk, mm_dtype, trans_b=True)
    dw_ref[b, ts, h, ks] = (-dot(dvn_ref[b, ts, h, :], hk, mm_dtype, trans_b=True)).astype(
        dw_ref.dtype)
    dkd_ref[b, ts, h, ks] = dot(vn_ref[b, ts, h, :], dhk, mm_dtype, trans_b=True)
    dgl_ref[b, c, h, ks] = jnp.sum(hk.astype(_F32) * dhk.astype(_F32), axis=1)


def chunk_sums_kernel(a_ref, b_ref, v_ref, do_ref, dvn_ref, vn_ref, dv_ref, daqk_ref, dl_ref,
                      dbeta_ref, *yu_ref, mm_dtype):
    """``dL = -yu v_new^T``: with ``v_new = A r`` (``r = beta v - beta k e^G h``) and
    ``A = (I + L)^{-1}``, ``dL = -A^T (dv_new r^T) A^T = -(A^T dv_new) v_new^T``, one [C, C]
    product instead of ``-(A^T dW) W^T - yu U^T`` per block pair. ``yu_ref`` (the channel key
    side's input) receives ``yu`` when given."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    yu = dot(a_ref[b, ts, h, :], dvn_ref[b, ts, h, :], mm_dtype, trans_a=True)  # d(beta v)
    beta = b_ref[b, ts, h].astype(_F32)
    dv_ref[b, ts, h, :] = (beta[:, None] * yu).astype(dv_ref.dtype)
    vn = vn_ref[b, ts, h, :]
    daqk_ref[b, ts, h, :] = dot(do_ref[b, ts, h, :], vn, mm_dtype, trans_b=True)
    dl_ref[b, ts, h, :] = -dot(yu, vn, mm_dtype, trans_b=True)
    for ref in yu_ref:
        ref[b, ts, h, :] = yu.astype(ref.dtype)
    dbeta_ref[b, ts, h] = jnp.sum(yu * v_ref[b, ts, h, :].astype(_F32), axis=1)
