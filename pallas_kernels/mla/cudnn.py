"""MLA prefill attention on cuDNN's fused flash attention (`jax.nn.dot_product_attention`).

cuDNN takes one head size for keys and values, so the values (V = 128) are zero-padded to the key
size (N + P = 192) and the output sliced back: the padded columns add nothing to the result. The
per-head keys and values of all S positions are expanded from the latents first (cuDNN reads
per-head keys), though never the per-head [T, S] scores.

A whole prompt (queries at 0..T-1 over keys 0..T-1, no left padding) uses cuDNN's own causal mask.
Anything else — a chunk continuing a cache, left-padded rows — passes the exact visibility of
``reference.attention_mask`` as a boolean mask [B, 1, T, S] shared by every head: cuDNN's causal
mask is aligned at the top left (it has no offset into the keys) and its padding mask hides keys at
the END of a row, so neither can express those problems. cuDNN turns the mask into an additive bias
it reads for every score, a slower kernel than its built-in masks; so the policy runs a chunk continuing a cache
without left padding as two built-in-mask calls instead (``cudnn_chunk.py``). The
mask costs B x T x S bytes (and cuDNN's bias made from it twice that), so dispatch bounds it
(``CUDNN_MAX_MASK_ELEMENTS``) and names the cases "cudnn" and "cudnn_masked".
Keys past the last query are masked, not skipped: a chunk at the start of a large cache does work
over the whole cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla.reference import attention_mask, continues_cache, expand_keys_values


def cudnn_mla_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                        q_offset: int | jax.Array = 0, start: jax.Array | None = None,
                        implementation: str = "cudnn") -> jax.Array:
    """-> [B, T, H, V]. `implementation` "xla" runs the same call through XLA's attention (tests on CPU)."""
    heads, qk_dim = q.shape[2], q.shape[3]
    value_dim = w_kv_b.shape[0] // heads - nope_dim
    k, v = expand_keys_values(latents, w_kv_b, heads, nope_dim, q.dtype)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - value_dim)))
    if not continues_cache(q_offset, q.shape[1], latents.shape[1]) and start is None:
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
    else:
        mask = attention_mask(q_offset + jnp.arange(q.shape[1]), jnp.arange(latents.shape[1]), start)
        mask = jnp.broadcast_to(mask, (q.shape[0], *mask.shape[1:]))[:, None]
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
    return out[..., :value_dim]
