"""Key side of the KDA backward's gradient pass by key-channel blocks (``key_side="channels"``).

One program per (chunk, block of ``bk`` key channels), grid ``(B, H, N, K / bk)``. Everything the
key side needs is per channel once the chunk's 16x16 blocks of ``dL`` and ``dAqk`` exist (the
chunk kernel forms them: ``dL = -yu v_new^T``, which contracts over V): the V-contracting sums of
the block's channels (``dQg = dO h^T``, ``dKd = v_new dh^T``, ``A^T dW = -yu h^T``,
``dgl = sum_V h dh``, from the block's rows of the chunk's state and state gradient) and then
``pallas_bwd_blocked.key_side`` on the block's channels. Only dbeta sums over channels: each
program writes its block's partial sums and the wrapper adds them.

Compared with the "blocks" key side (one program per chunk over all 128 channels, 255 registers
and kilobytes of spills per thread offline), each program holds ``[16, bk]`` tiles instead of
``[16, 128]`` ones and there are ``K / bk`` times as many programs. Not yet timed on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import BC, C, NC, dot
from pallas_kernels.kda.pallas_bwd_blocked import key_side

_F32 = jnp.float32


def channel_grads_kernel(q_ref, k_ref, g_ref, b_ref, hs_ref, dhs_ref, do_ref, vn_ref, yu_ref,
                         dl_ref, daqk_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, scale, mm_dtype,
                         bk):
    b, h, c, kb = (pl.program_id(i) for i in range(4))
    rs = lambda i: pl.ds(c * C + i * BC, BC)  # noqa: E731
    blk = lambda ref, i, j: ref[b, rs(i), h, pl.ds(j * BC, BC)]  # noqa: E731
    ks = pl.ds(kb * bk, bk)
    hk = hs_ref[b, c, h, ks, :]  # [bk, V]: this block's rows of the chunk's input state
    dhk = dhs_ref[b, c, h, ks, :]
    dkd = [dot(vn_ref[b, rs(i), h, :], dhk, mm_dtype, trans_b=True) for i in range(NC)]
    sums = dict(
        dqg=lambda i: dot(do_ref[b, rs(i), h, :], hk, mm_dtype, trans_b=True),
        dkd=dkd.__getitem__,
        yw=lambda i: -dot(yu_ref[b, rs(i), h, :], hk, mm_dtype, trans_b=True),
        dl=lambda i, j: blk(dl_ref, i, j),
        daqk=lambda i, j: blk(daqk_ref, i, j),
        dgl=jnp.sum(hk.astype(_F32) * dhk.astype(_F32), axis=1)[None, :],
    )

    def store_dbeta(i, dbeta):
        dbeta_ref[b, kb, rs(i), h] = dbeta

    key_side(b, h, c, ks, q_ref, k_ref, g_ref, b_ref, dq_ref, dk_ref, dg_ref, store_dbeta, sums,
             scale=scale, mm_dtype=mm_dtype)
