"""Key side of the KDA backward's per-chunk gradient pass, in 16-row sub-chunk blocks.

Same result as ``chunk_math.key_grads`` (dq, dk, dg, dbeta of one chunk from the V sums), but the
pairwise terms through ``L`` and ``Aqk`` are taken block by block: for every sub-chunk pair
``J <= I`` the ``[16, 16]`` blocks ``dL[I, J]`` and ``dAqk[I, J]`` (loaded from HBM, where the
chunk kernel of ``pallas_bwd_value.py`` left them), each with the decay factors of row block I's
midpoint. That is ~1.7M multiply-adds per chunk at 128 channels instead of the ~8.4M of the
whole-chunk masked products, since Pallas-Triton can only take sub-blocks of memory refs, not of
register values. Every term is per key channel except dbeta's channel sums, so
``pallas_bwd_channels.py`` runs this on one block of key channels per program.

Row blocks go from last to first: block I's row-side terms are complete after its own pairs, and
its column-side terms (from pairs ``I' >= I``) too, so each block is finished and stored at once;
the reverse cumsum of ``dG`` over the chunk is then a carried column sum.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_math import BC, C, CLAMP, MID, NC, dot, pair_dtype, row
from pallas_kernels.kda.intra_blocks import cumulative_gate

_F32 = jnp.float32


def key_grads_row_blocks(b, h, c, ks, q_ref, k_ref, g_ref, b_ref, dq_ref, dk_ref, dg_ref,
                         store_dbeta, sums, *, scale, mm_dtype) -> None:
    """Store dq, dk, dg of chunk c in key channels ``ks`` (a ``pl.ds``), and hand each
    row block's dbeta terms summed over those channels to ``store_dbeta(i, [16])``. ``sums``
    gives the V sums by row block: ``dqg(i)``, ``dkd(i)``, ``yw(i)`` = (A^T dW)_i [16, |ks|],
    ``dl(i, j)`` and ``daqk(i, j)`` [16, 16] for ``j <= i`` (masking of the diagonal
    blocks is done here) and ``dgl`` [1, |ks|]. Every term is per channel except the dbeta sums."""
    t0 = c * C
    rs = lambda i: pl.ds(t0 + i * BC, BC)  # noqa: E731
    ld = lambda ref, i: ref[b, rs(i), h, ks].astype(_F32)  # noqa: E731
    ri = lax.broadcasted_iota(jnp.int32, (BC, BC), 0)
    ci = lax.broadcasted_iota(jnp.int32, (BC, BC), 1)

    Gs, G_last = [], jnp.zeros((ks.size,), _F32)
    for i in range(NC):
        G, G_last = cumulative_gate(ld(g_ref, i), G_last, lambda g: g)  # g is the log-decay itself
        Gs.append(G)
    mids = [row(G, MID) for G in Gs]
    dG_last = sums["dgl"] * jnp.exp(G_last)
    for i in range(NC):
        dG_last = dG_last + jnp.sum(sums["dkd"](i) * ld(k_ref, i) * jnp.exp(G_last - Gs[i]),
                                    axis=0)[None, :]

    pm = pair_dtype(mm_dtype)
    cols = [None] * NC  # column-side sums of each block, complete once its row block is done
    suffix = jnp.zeros_like(G_last)
    for i in reversed(range(NC)):
        k, G = ld(k_ref, i), Gs[i]
        qs = ld(q_ref, i) * scale
        beta = b_ref[b, rs(i), h].astype(_F32)[:, None]
        rf = jnp.exp(G - mids[i])
        bkr, qsr = beta * k * rf, qs * rf
        yw = sums["yw"](i)
        rk = rq = None
        for j in range(i + 1):
            cf = jnp.exp(jnp.minimum(mids[i] - Gs[j], CLAMP))
            kc = ld(k_ref, j) * cf
            dl = sums["dl"](i, j)
            da = sums["daqk"](i, j)
            if i == j:
                dl = jnp.where(ri > ci, dl, 0.0)
                da = jnp.where(ri >= ci, da, 0.0)
            prk, prq = dot(dl, kc, pm), dot(da, kc, pm)
            rk, rq = (prk, prq) if rk is None else (rk + prk, rq + prq)
            pc = cf * (dot(dl, bkr, pm, trans_a=True) + dot(da, qsr, pm, trans_a=True))
            cols[j] = pc if cols[j] is None else cols[j] + pc
        rk, rq = rf * rk, rf * rq

        eg, ed = jnp.exp(G), jnp.exp(G_last - G)
        dkd = sums["dkd"](i)
        dqs = sums["dqg"](i) * eg + rq
        dk = beta * rk + cols[i] + beta * yw * eg + dkd * ed
        dG = qs * dqs + beta * k * rk - k * cols[i] + beta * yw * k * eg - dkd * k * ed
        store_dbeta(i, jnp.sum(yw * k * eg, axis=1) + jnp.sum(k * rk, axis=1))
        col_sum = jnp.sum(dG, axis=0)[None, :]
        dg = col_sum - jnp.cumsum(dG, axis=0) + dG + suffix + dG_last
        suffix = suffix + col_sum
        dq_ref[b, rs(i), h, ks] = (dqs * scale).astype(dq_ref.dtype)
        dk_ref[b, rs(i), h, ks] = dk.astype(dk_ref.dtype)
        dg_ref[b, rs(i), h, ks] = dg.astype(dg_ref.dtype)
