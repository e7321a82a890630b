"""Key side of the KDA backward's gradient pass by key-channel blocks, on whole 64-row chunks.

One program per (chunk, block of ``bk`` key channels), grid ``(K / bk, H, N, B)``: the channel
block varies fastest, so the programs of one chunk run together and its ``dL``, ``dAqk``, ``dO``,
``v_new`` and ``yu``, which each of them reads whole, come from L2 after the first (faster than
the batch fastest; benchmarks/RESULTS.md). Everything the key side needs is per channel once the
chunk's ``dL`` and ``dAqk`` exist (the chunk kernel forms them: ``dL = -yu v_new^T``, which
contracts over V): the V-contracting sums of the block's channels (``dQg = dO h^T``,
``dKd = v_new dh^T``, ``A^T dW = -yu h^T``, ``dgl = sum_V h dh``, from the block's rows of the
chunk's state and state gradient) and then ``chunk_math.key_grads_from_sums`` on the block's
channels, the same algebra as the pure-JAX backward: the pair terms as [64, 64] x [64, bk]
products masked by row block. Only dbeta sums over channels: each program writes its block's
partial sums and the wrapper adds them.

A key side by 16x16 blocks (the pair terms block by block, about 5x fewer multiply-adds) and one
per chunk over all channels were both measured slower and removed (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import C, causal_masks, dot, key_grads_from_sums, row_block
from pallas_kernels.kda.triton.intra_blocks import gate_exp

_F32 = jnp.float32


def channel_grads_kernel(q_ref, k_ref, g_ref, b_ref, hs_ref, dhs_ref, do_ref, vn_ref, yu_ref,
                         dl_ref, daqk_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, scale, mm_dtype,
                         bk, approx):
    """Each row block of dL and dAqk is loaded when its products need it and the V sums are
    formed after the pair terms, which keeps fewer tiles live at once. ``approx``: the hardware
    exp2 (``intra_blocks.gate_exp``), for bf16 inputs on GPU."""
    kb, h, c, b = (pl.program_id(i) for i in range(4))
    ts = pl.ds(c * C, C)
    ks = pl.ds(kb * bk, bk)
    causal, strict = causal_masks()

    def rows(ref, mask):
        return lambda i: row_block(jnp.where(mask, ref[b, ts, h, :], 0.0), i)

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
        rows(dl_ref, strict), rows(daqk_ref, causal), v_sums, mm_dtype, *gate_exp(approx))
    dq_ref[b, ts, h, ks] = (dqs * scale).astype(dq_ref.dtype)
    dk_ref[b, ts, h, ks] = dk.astype(dk_ref.dtype)
    dg_ref[b, ts, h, ks] = dg.astype(dg_ref.dtype)
    dbeta_ref[b, kb, ts, h] = dbeta
