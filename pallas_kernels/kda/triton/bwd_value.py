"""The chunk sums of the KDA backward's gradient pass, as a Pallas kernel body.

Per chunk, grid ``(B, H, N)`` (math: ``chunk_math.value_terms``), with ``v_new = U - W h``
(stored by the state recurrence, which forms it anyway) and its gradient ``dv_new``:
``yu = A^T dv_new`` (the gradient of ``beta v``), ``dv = beta yu``, ``dAqk = dO v_new^T``,
``dL = -yu v_new^T`` and ``dbeta = sum_V yu * v`` (the value part of dbeta). dAqk and dL go to
HBM in fp32, yu in the operand dtype, for the key side by key-channel blocks
(``pallas_bwd_channels.py``), which forms the key-channel sums (``dO h^T``, ``v_new dh^T``, ...)
itself from the chunk's state.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, dot

_F32 = jnp.float32


def chunk_sums_kernel(a_ref, b_ref, v_ref, do_ref, dvn_ref, vn_ref, dv_ref, daqk_ref, dl_ref,
                      dbeta_ref, yu_ref, *, mm_dtype):
    """``dL = -yu v_new^T``: with ``v_new = A r`` (``r = beta v - beta k e^G h``) and
    ``A = (I + L)^{-1}``, ``dL = -A^T (dv_new r^T) A^T = -(A^T dv_new) v_new^T``, one [C, C]
    product instead of ``-(A^T dW) W^T - yu U^T`` per block pair. ``yu`` itself goes to
    ``yu_ref`` for the key side."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ts = pl.ds(c * C, C)
    yu = dot(a_ref[b, ts, h, :], dvn_ref[b, ts, h, :], mm_dtype, trans_a=True)  # d(beta v)
    beta = b_ref[b, ts, h].astype(_F32)
    dv_ref[b, ts, h, :] = (beta[:, None] * yu).astype(dv_ref.dtype)
    vn = vn_ref[b, ts, h, :]
    daqk_ref[b, ts, h, :] = dot(do_ref[b, ts, h, :], vn, mm_dtype, trans_b=True)
    dl_ref[b, ts, h, :] = -dot(yu, vn, mm_dtype, trans_b=True)
    yu_ref[b, ts, h, :] = yu.astype(yu_ref.dtype)
    dbeta_ref[b, ts, h] = jnp.sum(yu * v_ref[b, ts, h, :].astype(_F32), axis=1)
