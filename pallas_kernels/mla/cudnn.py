"""MLA prefill attention on cuDNN's fused flash attention (`jax.nn.dot_product_attention`), for a
whole prompt without a cache (queries and keys at the same positions 0..T-1).

cuDNN takes one head size for keys and values, so the values (V = 128) are zero-padded to the key
size (N + P = 192) and the output sliced back: the padded columns add nothing to the result. The
per-head keys and values of all T positions are expanded from the latents first (cuDNN reads
per-head keys), though never the [T, T] scores.

Why only that case: cuDNN's causal mask is aligned at the top left and its padding mask hides keys
from the END of a row. A chunk at a cache offset would be two calls merged by their log-sum-exps,
which this API returns rounded to the output dtype (bf16: about 3% error in the merge weights at
typical magnitudes); left padding needs a mask from the START of a row, which it has no form of. Such
problems go to the blockwise implementation (see dispatch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla.reference import expand_keys_values


def cudnn_mla_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                        q_offset: int | jax.Array = 0, start: jax.Array | None = None,
                        implementation: str = "cudnn") -> jax.Array:
    """-> [B, T, H, V]. `implementation` "xla" runs the same call through XLA's attention (tests on CPU)."""
    if start is not None or not isinstance(q_offset, int) or q_offset != 0 or latents.shape[1] != q.shape[1]:
        raise ValueError("cudnn_mla_attention: only a whole prompt without a cache or left padding "
                         f"(q_offset 0, S == T); got q_offset={q_offset!r}, T={q.shape[1]}, S={latents.shape[1]}, "
                         f"start {'given' if start is not None else 'None'}")
    heads, qk_dim = q.shape[2], q.shape[3]
    value_dim = w_kv_b.shape[0] // heads - nope_dim
    k, v = expand_keys_values(latents, w_kv_b, heads, nope_dim, q.dtype)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - value_dim)))
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
    return out[..., :value_dim]
