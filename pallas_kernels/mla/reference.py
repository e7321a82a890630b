"""MLA prefill attention in pure JAX: the per-head keys and values are expanded from the cached latents
with W_UK / W_UV (`kv_b_proj`), and attended causally with an fp32 softmax.

Inputs of every implementation (k3-architecture.md §6.1, NoPE MLA):
  q        [B, T, H, N + P]  queries of T new tokens at positions q_offset .. q_offset + T - 1
  latents  [B, S, R + P]     per-position latents c_kv (R) || k_pe (P), positions 0 .. S - 1
  w_kv_b   [H * (N + V), R]  kv_b_proj's weight: per head, N rows of W_UK then V rows of W_UV
  start    int32 [B] | None  first real position of each row (left padding before it)
  segment_ids int32 [B, S] | None  packed documents (training, no cache: T = S): their ids
Key s is visible to query t when s <= t and (s >= start[b] or s == t): causal, left pads hidden
(a pad query still sees itself, so no softmax row is empty), keys past the last query unread; with
segment ids, only keys of the query's own document (K3 has no positional encoding, so a packed
document needs nothing else to match the document alone).

`blockwise_mla_attention` is the flash-style algorithm: key blocks of `block_k` positions are
expanded one at a time and folded into a running max / sum / output per query (online softmax), so
neither the [T, S] scores nor the per-head keys of all S positions are ever in memory; key blocks
wholly after the last query are skipped. `naive_mla_attention` builds everything at once (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.precision import exact_if_fp32

F32 = jnp.float32
_FLOOR = -1e30  # the running max before any visible key: finite, so exp(m - m_new) never sees inf - inf


def attention_mask(query_pos: jax.Array, key_pos: jax.Array, start: jax.Array | None,
                   query_seg: jax.Array | None = None, key_seg: jax.Array | None = None) -> jax.Array:
    """bool [B or 1, T, S]: key visible to query (causal; with `start`, left pads hidden but from
    themselves; with segment ids [B, T] / [B, S], only keys of the query's document)."""
    visible = key_pos[None, :] <= query_pos[:, None]
    mask = visible[None]
    if start is not None:
        real = (key_pos[None, None, :] >= start[:, None, None]) | (key_pos[None, :] == query_pos[:, None])[None]
        mask = mask & real
    if query_seg is not None:
        mask = mask & (query_seg[:, :, None] == key_seg[:, None, :])
    return mask


def continues_cache(q_offset: int | jax.Array, queries: int, keys: int) -> bool:
    """Whether T queries at `q_offset` over S keys are a chunk continuing a cache rather than a whole
    prompt (offset 0, known statically, and S == T)."""
    return not (isinstance(q_offset, int) and q_offset == 0 and keys == queries)


def expand_keys_values(latents: jax.Array, w_kv_b: jax.Array, num_heads: int, nope_dim: int,
                       dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Latents [B, S, R + P] -> keys [B, S, H, N + P] (k_pe shared by every head) and values [B, S, H, V],
    in `dtype` (the matmul accumulates in fp32 and rounds once, as the model's projections do; asked for
    in `dtype` so that its backward's GEMMs stay in `dtype` too, see `k3jax.nn.layers.linear`)."""
    rank = w_kv_b.shape[1]
    c = latents[..., :rank].astype(dtype)
    kv = jnp.einsum("bsr,or->bso", c, w_kv_b.astype(dtype), preferred_element_type=dtype,
                    precision=exact_if_fp32(dtype))
    kv = kv.reshape(*c.shape[:2], num_heads, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k_pe = jnp.broadcast_to(latents[:, :, None, rank:].astype(dtype), (*k_nope.shape[:3], latents.shape[-1] - rank))
    return jnp.concatenate([k_nope, k_pe], axis=-1), v


def naive_mla_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                        q_offset: int | jax.Array = 0, start: jax.Array | None = None,
                        segment_ids: jax.Array | None = None) -> jax.Array:
    """All keys expanded and all [B, H, T, S] scores at once; softmax in fp32. -> [B, T, H, V]."""
    k, v = expand_keys_values(latents, w_kv_b, q.shape[2], nope_dim, q.dtype)
    precision = exact_if_fp32(q.dtype)
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=F32, precision=precision) * scale
    mask = attention_mask(q_offset + jnp.arange(q.shape[1]), jnp.arange(k.shape[1]), start,
                          segment_ids, segment_ids)[:, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v, preferred_element_type=F32, precision=precision).astype(q.dtype)


def _blocks(x: jax.Array, size: int, axis: int) -> jax.Array:
    """x padded with zeros along `axis` to a multiple of `size`, then split: [n, ...x with size at axis]."""
    pad = -x.shape[axis] % size
    x = jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)])
    x = x.reshape(*x.shape[:axis], -1, size, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def blockwise_mla_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                            q_offset: int | jax.Array = 0, start: jax.Array | None = None,
                            segment_ids: jax.Array | None = None, block_q: int = 512,
                            block_k: int = 512) -> jax.Array:
    """Flash-style attention over key blocks (see the module docstring). -> [B, T, H, V] in q's dtype.

    Memory: one key block's expanded keys/values [B, block_k, H, N + P + V] and one [B, H, block_q,
    block_k] fp32 score tile at a time, plus the fp32 running output [B, T, H, V]."""
    batch, seq, heads, _ = q.shape
    value_dim = w_kv_b.shape[0] // heads - nope_dim
    bq, bk = min(block_q, seq), min(block_k, latents.shape[1])
    precision = exact_if_fp32(q.dtype)
    q_blocks = _blocks(q, bq, 1)  # [nq, B, bq, H, D]
    q_pos = q_offset + jnp.arange(q_blocks.shape[0] * bq).reshape(-1, bq)
    k_blocks = _blocks(latents, bk, 1)  # [nk, B, bk, R + P]; padded keys lie after every query
    k_pos = jnp.arange(k_blocks.shape[0] * bk).reshape(-1, bk)
    nq = q_blocks.shape[0]
    # Segment ids per query block [nq, B, bq] and key block [nk, B, bk] (padding: id -1, never read).
    q_seg = k_seg = None
    if segment_ids is not None:
        q_seg = _blocks(segment_ids + 1, bq, 1) - 1
        k_seg = _blocks(segment_ids + 1, bk, 1) - 1
    carry = (jnp.full((nq, batch, heads, bq), _FLOOR, F32), jnp.zeros((nq, batch, heads, bq), F32),
             jnp.zeros((nq, batch, bq, heads, value_dim), F32))

    def fold(k: jax.Array, v: jax.Array, keys_at: jax.Array, keys_seg: jax.Array | None, block):
        """Fold one key block into one query block's running (max, sum, output)."""
        q_blk, rows_at, rows_seg, m, l, acc = block
        s = jnp.einsum("bthd,bshd->bhts", q_blk, k, preferred_element_type=F32, precision=precision) * scale
        mask = attention_mask(rows_at, keys_at, start, rows_seg, keys_seg)[:, None]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _FLOOR), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bhts,bshv->bthv", p.astype(q.dtype), v, preferred_element_type=F32, precision=precision)
        acc = acc * jnp.moveaxis(alpha, 1, 2)[..., None] + pv
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc

    def key_step(carry, block):
        lat, keys_at, keys_seg = block

        def attend(carry):
            k, v = expand_keys_values(lat, w_kv_b, heads, nope_dim, q.dtype)

            def one(args):
                _, rows_at, _, m, l, acc = args
                return jax.lax.cond(keys_at[0] <= rows_at[-1], lambda: fold(k, v, keys_at, keys_seg, args),
                                    lambda: (m, l, acc))

            return jax.lax.map(one, (q_blocks, q_pos, q_seg, *carry))

        return jax.lax.cond(keys_at[0] <= q_offset + seq - 1, attend, lambda c: c, carry), None

    if nq == 1 and k_blocks.shape[0] == 1:  # one tile: no loops to compile
        k, v = expand_keys_values(k_blocks[0], w_kv_b, heads, nope_dim, q.dtype)
        first = (q_blocks[0], q_pos[0], None if q_seg is None else q_seg[0], *(c[0] for c in carry))
        _, l, acc = (x[None] for x in fold(k, v, k_pos[0], None if k_seg is None else k_seg[0], first))
    else:
        # Checkpointed per key block: differentiating the scan then saves only each step's running
        # (max, sum, output) and recomputes the block's scores in the backward pass, as flash attention's
        # backward does, instead of keeping every block's [B, H, block_q, block_k] fp32 tiles (memory
        # quadratic in the sequence, which dominated a training step's temporaries at 4K tokens).
        (_, l, acc), _ = jax.lax.scan(jax.checkpoint(key_step), carry, (k_blocks, k_pos, k_seg))
    # A real query sees at least itself (l > 0); the padding rows of the last query block may see
    # nothing, and their l = 0 must not put 0/0 into the gradient.
    out = acc / jnp.moveaxis(jnp.where(l > 0, l, 1.0), 2, 3)[..., None]
    return jnp.moveaxis(out, 0, 1).reshape(batch, nq * bq, heads, value_dim)[:, :seq].astype(q.dtype)
