"""KDA intra-chunk stage in key-channel blocks (``intra="kblock"``): small live sets, one kernel.

The intra stage's outputs (W, U, Qg, Kd, Aqk, e^{G_last}; see ``pallas_kda.py``) are built from
per-channel quantities: the cumulative gate ``G`` runs along time separately in every key
channel, and the 16x16 blocks of ``L`` and ``Aqk`` are sums over channels. So the kernel walks the
key channels in blocks of ``block_k`` and accumulates the twenty 16x16 blocks (ten of L, ten of
Aqk) over them, holding only ``[16, block_k]`` tiles of q, k and G, instead of whole
``[16, K]`` fp32 rows of four sub-chunks at once as the "v1" kernel does. That whole-row live
set is what made v1 spill (255 registers per thread and 12.5% occupancy under ncu on an H200,
benchmarks/RESULTS.md). Qg, Kd and e^{G_last} of a channel block are final once its four
sub-chunks are summed, so they are stored in the same pass.

After the channel loop: the 64x64 inverse ``X = (I + L)^{-1}`` from the 16x16 blocks (as v1),
then ``W = X (beta k e^G)`` in a second pass over the channel blocks (recomputing k's norm
factor and G, which is cheaper than keeping them) and ``U = X (beta v)`` over value blocks.

The fused q/k L2 norm needs each row's norm over all channels before the first block: a short
first pass reads q and k once for the row norms (kept as [16] vectors per sub-chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import BC, C, NC
from pallas_kernels.kda.intra_blocks import (
    activations, cumulative_gate, inv_l2_norm, matmul_dtypes, row_blocks, row_product, store_row,
    unit_lower_inverse,
)

_F32 = jnp.float32
N_BLOCKS = NC * (NC + 1) // 2  # 16x16 blocks on or below the diagonal of a 64x64 chunk matrix


def _intra_kblock_kernel(
    q_ref, k_ref, v_ref, g_ref, b_ref, *rest, scale, mm_dtype, fused, lower_bound, block_k,
    block_v,
):
    gs_ref, db_ref, rest = (*rest[:2], rest[2:]) if fused else (None, None, rest)
    w_ref, u_ref, qg_ref, kd_ref, a_ref, gl_ref = rest
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K, V = q_ref.shape[-1], v_ref.shape[-1]
    sd = qg_ref.dtype
    rows = [pl.ds(c * C + i * BC, BC) for i in range(NC)]
    beta_of = activations(fused, lower_bound, gs_ref, db_ref, h)[2]
    betas = [beta_of(b_ref[b, r, h]) for r in rows]
    if fused:  # per-row factors of the L2 norm (scale folded into q's)
        q_fac = [scale * inv_l2_norm(q_ref[b, r, h, :]) for r in rows]
        k_fac = [inv_l2_norm(k_ref[b, r, h, :]) for r in rows]

    def channel_block(kb):
        """(channels, normalised k, cumulative gates G per sub-chunk, G_last) of block kb."""
        ks = pl.ds(kb * block_k, block_k)
        gate = activations(fused, lower_bound, gs_ref, db_ref, h, ks)[0]
        G_last = jnp.zeros((block_k,), _F32)
        kk, Gs = [], []
        for i, r in enumerate(rows):
            G, G_last = cumulative_gate(g_ref[b, r, h, ks], G_last, gate)
            k = k_ref[b, r, h, ks].astype(_F32)
            kk.append(k * k_fac[i][:, None] if fused else k)
            Gs.append(G)
        return ks, kk, Gs, G_last

    def accumulate_blocks(kb, acc):
        ks, kk, Gs, G_last = channel_block(kb)
        acc, n = list(acc), 0
        for i, r in enumerate(rows):
            q = q_ref[b, r, h, ks].astype(_F32)
            qs = q * q_fac[i][:, None] if fused else q * scale
            qg_ref[b, r, h, ks] = (qs * jnp.exp(Gs[i])).astype(sd)
            kd_ref[b, r, h, ks] = (kk[i] * jnp.exp(G_last[None, :] - Gs[i])).astype(sd)
            L_row, A_row = row_blocks(i, qs, betas[i], kk[: i + 1], Gs[: i + 1], mm_dtype)
            for lk, aq in zip(L_row, A_row):
                acc[n], acc[n + 1] = acc[n] + lk, acc[n + 1] + aq
                n += 2
        gl_ref[b, c, h, ks] = jnp.exp(G_last)
        return tuple(acc)

    zero = jnp.zeros((BC, BC), _F32)
    acc = lax.fori_loop(0, K // block_k, accumulate_blocks, (zero,) * (2 * N_BLOCKS))
    L, n = {}, 0
    for i, r in enumerate(rows):
        A_row = []
        for j in range(i + 1):
            L[i, j] = acc[n]
            A_row.append(acc[n + 1])
            n += 2
        store_row(a_ref, b, r, h, A_row)
    X = unit_lower_inverse(L)

    def store_w(kb, carry):
        ks, kk, Gs, _ = channel_block(kb)
        bk = [betas[j][:, None] * kk[j] * jnp.exp(Gs[j]) for j in range(NC)]
        for i, r in enumerate(rows):
            w_ref[b, r, h, ks] = row_product(i, X, bk.__getitem__, mm_dtype).astype(sd)
        return carry

    def store_u(vb, carry):
        vs = pl.ds(vb * block_v, block_v)
        bv = [betas[j][:, None] * v_ref[b, r, h, vs].astype(_F32) for j, r in enumerate(rows)]
        for i, r in enumerate(rows):
            u_ref[b, r, h, vs] = row_product(i, X, bv.__getitem__, mm_dtype).astype(u_ref.dtype)
        return carry

    lax.fori_loop(0, K // block_k, store_w, 0)
    lax.fori_loop(0, V // block_v, store_u, 0)


def _divisor_block(block: int, n: int) -> int:
    """``block`` if it divides ``n``, else the whole width (interpret mode allows any K, V)."""
    return block if n % block == 0 else n


def intra_kblock(ins, *, scale, fused, lower_bound, block, interpret, params):
    """The intra stage in channel blocks of ``block`` (key channels for L/Aqk/W, value channels
    for U; the whole width where ``block`` does not divide it): ``(W, U, Qg, Kd, Aqk, e^{G_last})`` as the other variants.
    ``ins``: q, k, v, g, beta [, gate_scale, dt_bias when ``fused``]."""
    q, v = ins[0], ins[2]
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    n = Tp // C
    _, sd = matmul_dtypes(v)
    sds = jax.ShapeDtypeStruct
    kernel = functools.partial(
        _intra_kblock_kernel, scale=scale, mm_dtype=matmul_dtypes(v)[0], fused=fused,
        lower_bound=lower_bound, block_k=_divisor_block(block, K), block_v=_divisor_block(block, V),
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, n),
        out_shape=(
            sds((B, Tp, H, K), sd),  # W
            sds((B, Tp, H, V), sd),  # U
            sds((B, Tp, H, K), sd),  # Qg
            sds((B, Tp, H, K), sd),  # Kd
            sds((B, Tp, H, C), sd),  # Aqk
            sds((B, n, H, K), _F32),  # e^{G_last}
        ),
        interpret=interpret,
        name="kda_intra_kblock",
        **params,
    )(*ins)
