"""Key side of the KDA backward's gradient pass by key-channel blocks.

One program per (chunk, block of ``bk`` key channels), grid ``(B, H, N, K / bk)``. Everything the
key side needs is per channel once the chunk's 16x16 blocks of ``dL`` and ``dAqk`` exist (the
chunk kernel forms them: ``dL = -yu v_new^T``, which contracts over V): the V-contracting sums of
the block's channels (``dQg = dO h^T``, ``dKd = v_new dh^T``, ``A^T dW = -yu h^T``,
``dgl = sum_V h dh``, from the block's rows of the chunk's state and state gradient) and then
``pallas_bwd_row_blocks.key_grads_row_blocks`` on the block's channels. Only dbeta sums over
channels: each program writes its block's partial sums and the wrapper adds them.

Each program holds ``[16, bk]`` tiles instead of ``[16, 128]`` ones, with ``K / bk`` times as
many programs as chunks (offline at 32 channels, 4 warps: 255 registers, no spills). The former
per-chunk key side ("blocks": the channel sums through HBM, then one program per chunk over all
128 channels, 255 registers and 2,064 / 2,524 B of spills per thread offline) was measured
slower on an H200 and removed: whole backward 45.47 vs 48.17 ms (its best setting) at
B4 T8192 H96, 10.36 vs 10.70 ms at B1 T32768 H16 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import BC, C, NC, causal_masks, dot, key_grads_from_sums
from pallas_kernels.kda.pallas_bwd_row_blocks import key_grads_row_blocks

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

    key_grads_row_blocks(b, h, c, ks, q_ref, k_ref, g_ref, b_ref, dq_ref, dk_ref, dg_ref,
                         store_dbeta, sums, scale=scale, mm_dtype=mm_dtype)


def channel_grads_wide_kernel(q_ref, k_ref, g_ref, b_ref, hs_ref, dhs_ref, do_ref, vn_ref, yu_ref,
                              dl_ref, daqk_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, scale,
                              mm_dtype, bk):
    """As ``channel_grads_kernel`` on whole 64-row chunks (``chunk_math.key_grads_from_sums``):
    the pair terms as [64, 64] x [64, bk] products masked by row block, not 16x16 blocks. Each
    row block of dL and dAqk is loaded when its products need it and the V sums are formed after
    the pair terms, which keeps fewer tiles live at once."""
    b, h, c, kb = (pl.program_id(i) for i in range(4))
    ts = pl.ds(c * C, C)
    ks = pl.ds(kb * bk, bk)
    causal, strict = causal_masks()
    block = lax.broadcasted_iota(jnp.int32, (C, C), 0) // BC

    def rows(ref, mask):
        return lambda i: jnp.where(mask & (block == i), ref[b, ts, h, :], 0.0)

    def v_sums():
        hk = hs_ref[b, c, h, ks, :]  # [bk, V]: this block's rows of the chunk's input state
        dhk = dhs_ref[b, c, h, ks, :]
        return (
            -dot(yu_ref[b, ts, h, :], hk, mm_dtype, trans_b=True),
            dot(do_ref[b, ts, h, :], hk, mm_dtype, trans_b=True),
            dot(vn_ref[b, ts, h, :], dhk, mm_dtype, trans_b=True),
            jnp.sum(hk.astype(_F32) * dhk.astype(_F32), axis=1)[None, :],
        )

    dqs, dk, dg, dbeta = key_grads_from_sums(
        q_ref[b, ts, h, ks].astype(_F32) * scale, k_ref[b, ts, h, ks].astype(_F32),
        g_ref[b, ts, h, ks].astype(_F32), b_ref[b, ts, h].astype(_F32),
        rows(dl_ref, strict), rows(daqk_ref, causal), v_sums, mm_dtype)
    dq_ref[b, ts, h, ks] = (dqs * scale).astype(dq_ref.dtype)
    dk_ref[b, ts, h, ks] = dk.astype(dk_ref.dtype)
    dg_ref[b, ts, h, ks] = dg.astype(dg_ref.dtype)
    dbeta_ref[b, kb, ts, h] = dbeta
