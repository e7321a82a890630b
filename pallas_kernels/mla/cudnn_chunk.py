"""A prefill chunk continuing a cache on cuDNN without a mask: two unmasked-shape calls merged exactly.

The T queries of a chunk at positions P..P+T-1 see every cached key before P, and their own keys
causally. cuDNN's causal mask is aligned at the top left (no offset into the keys), and an explicit
mask becomes an additive bias that cuDNN reads for every score (``cudnn.py``, far slower than its
built-in masks). So the chunk runs as two calls that each use a built-in mask:

  past: the queries over keys 0..S-1 with cuDNN's padding mask hiding keys from P on (kv_seqlen = P);
  own:  the queries over the chunk's own T keys with cuDNN's causal mask (top left is the diagonal);
  merge (fp32): each call's output weighted by e^(its log-sum-exp of scaled scores), normalised
        (``absorbed.merge_partials``) — the softmax over the union of both key sets, exactly.

The merge needs the log-sum-exps in fp32: ``jax.nn.dot_product_attention(..., return_residual=True)``
casts them to the output dtype (bf16 log-sum-exps of ~10 are off by ~0.02, a ~2% merge-weight error),
so the cuDNN call goes through jax's own cuDNN entry (``jax._src.cudnn.fused_attention_stablehlo``),
which returns them as cuDNN computes them, in fp32. A long cache's past runs as several calls over
blocks of positions (``past_block``), each expanding only its own keys and values, merged the same
way; blocks at or past the offset (all of them for the first chunk, P = 0) are skipped. With
``implementation="xla"`` the same calls and merge run through XLA's attention (CPU tests; exact in
fp32 inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

from pallas_kernels.mla.absorbed import Partial, merge_partials
from pallas_kernels.mla.reference import expand_keys_values

F32 = jnp.float32


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool, kv_length: jax.Array | None,
            implementation: str) -> tuple[jax.Array, jax.Array]:
    """-> (out [B, T, H, D] in q's dtype, log-sum-exp [B, T, H] fp32). `kv_length` [B]: keys from it on hidden."""
    batch, seq = q.shape[:2]
    if implementation == "xla":
        out, lse = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, key_value_seq_lengths=kv_length,
                                                implementation="xla", return_residual=True)
        return out, lse.astype(F32)
    if kv_length is None:
        out, lse = cudnn_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
                                   return_residual=True)
    else:
        q_length = jnp.full((batch,), seq, jnp.int32)
        mask_type = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING
        out, lse = cudnn_attention(q, k, v, q_seqlen=q_length, kv_seqlen=kv_length, scale=scale, mask_type=mask_type,
                                   return_residual=True)
    return out, jnp.swapaxes(lse, 1, 2).astype(F32)  # cuDNN gives [B, H, T]


def cudnn_chunk_mla_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                              q_offset: int | jax.Array, start: jax.Array | None = None,
                              implementation: str = "cudnn", past_block: int | None = None) -> jax.Array:
    """-> [B, T, H, V] for T queries at q_offset over the latents of positions 0..S-1 (no left padding).

    `past_block`: cached positions expanded and attended per past call (None: all S in one). Each
    call's per-head keys and values take 74 KB a position at K3's widths, so a bound keeps a 1M-token
    cache's chunk within memory; the calls' partials merge exactly like the past and own ones."""
    if start is not None:
        raise ValueError("cudnn_chunk_mla_attention: left-padded rows need a mask ('cudnn_masked' or 'xla')")
    batch, seq, heads, qk_dim = q.shape
    total = latents.shape[1]
    blocks = 1 if past_block is None else -(-total // max(1, past_block))
    block = -(-total // blocks)  # balanced; the padded tail lies past the cache, hidden like any key from the offset on
    value_dim = w_kv_b.shape[0] // heads - nope_dim
    offset = jnp.asarray(q_offset, jnp.int32)
    padded = jnp.pad(latents, ((0, 0), (0, blocks * block - total), (0, 0)))

    def keys_values(lat: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, v = expand_keys_values(lat, w_kv_b, heads, nope_dim, q.dtype)
        return k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - value_dim)))  # cuDNN: one head size

    def attend_block(first: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The queries over keys first..first+block-1, those from the offset on hidden."""
        k, v = keys_values(jax.lax.dynamic_slice_in_dim(padded, first, block, axis=1))
        length = jnp.full((batch,), jnp.clip(offset - first, 1, block), jnp.int32)
        return _attend(q, k, v, scale=scale, causal=False, kv_length=length, implementation=implementation)

    def skip_block(_: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A block wholly at or past the offset (or the first chunk's empty past): weight 0, nothing expanded."""
        return jnp.zeros((batch, seq, heads, qk_dim), q.dtype), jnp.full((batch, seq, heads), -jnp.inf, F32)

    def past_call(_, first: jax.Array) -> tuple[None, tuple[jax.Array, jax.Array]]:
        return None, jax.lax.cond(first < offset, attend_block, skip_block, first)

    # One block at a time under `lax.scan`, so only one block's keys and values are ever expanded.
    _, (past, past_lse) = jax.lax.scan(past_call, None, jnp.arange(blocks, dtype=jnp.int32) * block)
    own_k, own_v = keys_values(jax.lax.dynamic_slice_in_dim(latents, offset, seq, axis=1))
    own, own_lse = _attend(q, own_k, own_v, scale=scale, causal=True, kv_length=None, implementation=implementation)
    # Each call's normalised output is a partial with sum 1 and max = its log-sum-exp.
    lses = jnp.concatenate([past_lse, own_lse[None]])
    parts = Partial(max=lses, sum=jnp.ones(lses.shape, F32),
                    out=jnp.concatenate([past, own[None]]).astype(F32))
    return merge_partials(parts)[..., :value_dim].astype(q.dtype)
