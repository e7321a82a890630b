"""Absorbed-form MLA decode attention split over key ranges: each range's partial softmax statistics,
and their merge (k3-architecture.md §6.1; the math of ``sharding.context_parallel``).

In the absorbed form W_UK is folded into the query, so a query attends over the latents directly:
score(s) = scale * (q_latent . c_s + q_pe . k_pe_s), output sum_s p_s c_s (W_UV applied after). Split
the keys into ranges; range i gives, per (row, query, head), all fp32:
  max  m_i = the largest visible score (-inf when the range has no visible key)
  sum  l_i = sum of exp(score - m_i) over its visible keys (0 when none)
  out  o_i = sum of exp(score - m_i) * c over its visible keys (un-normalised; 0 when none)
and the whole softmax is the log-sum-exp merge: M = max_i m_i, w_i = exp(m_i - M),
output = sum_i w_i o_i / sum_i w_i l_i. A range with no visible key has w_i = exp(-inf) = 0, so it
adds nothing; the -inf never meets another -inf in a subtraction (the per-range exponentials use a
finite stand-in max, the merge a finite stand-in M where no range sees a key), so nothing is NaN.
The merge is linear in `out`, so a caller may project each o_i (e.g. by W_UV) before merging.

Which keys a query sees is ``attention_mask`` with the keys' global positions: causal (positions
after the query, i.e. not yet written, are hidden) and left padding before ``start`` hidden, exactly
as the unsplit absorbed decode in ``k3jax/nn/mla.py`` masks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.mla.reference import attention_mask

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


class Partial(NamedTuple):
    """One key range's softmax statistics; a leading axis of ranges where several are stacked."""

    max: jax.Array  # fp32 [B, T, H]
    sum: jax.Array  # fp32 [B, T, H]
    out: jax.Array  # fp32 [B, T, H, R]


def absorbed_partial(q_latent: jax.Array, q_pe: jax.Array, latents: jax.Array, *, scale: float,
                     query_pos: jax.Array, key_pos: jax.Array, start: jax.Array | None) -> Partial:
    """The partial attention of queries over one range of cached latents.

    q_latent [B, T, H, R] (q_nope W_UK), q_pe [B, T, H, P], latents [B, S, R + P] (c || k_pe) of the
    range; query_pos int [T] and key_pos int [S] global positions; start int32 [B] or None."""
    rank = q_latent.shape[-1]
    c = latents[..., :rank].astype(F32)
    k_pe = latents[..., rank:].astype(F32)
    scores = jnp.einsum("bthr,bsr->bths", q_latent.astype(F32), c, precision=_HIGHEST)
    scores = scores + jnp.einsum("bthd,bsd->bths", q_pe.astype(F32), k_pe, precision=_HIGHEST)
    mask = attention_mask(query_pos, key_pos, start)[:, :, None]  # [B or 1, T, 1, S]
    scores = jnp.where(mask, scores * scale, -jnp.inf)
    m = jnp.max(scores, axis=-1)
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m)[..., None])  # masked: exp(-inf) = 0
    return Partial(m, jnp.sum(p, axis=-1), jnp.einsum("bths,bsr->bthr", p, c, precision=_HIGHEST))


def merge_partials(parts: Partial) -> jax.Array:
    """Partials stacked on a leading range axis [n, ...] -> the normalised output fp32 [B, T, H, R'].

    A query that no range lets see any key (not a decode step's case: a query always sees its own
    position) gets zeros rather than NaN."""
    top = jnp.max(parts.max, axis=0)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    weight = jnp.exp(parts.max - top)  # [n, B, T, H]; 0 for a range with nothing visible
    total = jnp.sum(weight * parts.sum, axis=0)
    out = jnp.sum(weight[..., None] * parts.out, axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def absorbed_attention(q_latent: jax.Array, q_pe: jax.Array, latents: jax.Array, *, scale: float,
                       query_pos: jax.Array, start: jax.Array | None, num_ranges: int = 1) -> jax.Array:
    """Absorbed attention over all S latents -> fp32 [B, T, H, R]: the model's single-device decode
    (one range); `num_ranges` equal key ranges (S divisible by it) merged give the same result and
    are what the context-parallel decode computes across devices."""
    seq = latents.shape[1]
    if seq % num_ranges:
        raise ValueError(f"absorbed_attention: {seq} latent positions do not split into {num_ranges} equal ranges")
    size = seq // num_ranges
    parts = [absorbed_partial(q_latent, q_pe, latents[:, i * size:(i + 1) * size], scale=scale,
                              query_pos=query_pos, key_pos=i * size + jnp.arange(size), start=start)
             for i in range(num_ranges)]
    return merge_partials(jax.tree.map(lambda *xs: jnp.stack(xs), *parts))
