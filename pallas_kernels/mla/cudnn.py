"""MLA prefill attention on cuDNN's fused flash attention (`jax.nn.dot_product_attention`).

cuDNN takes one head size for keys and values, so the values (V = 128) are zero-padded to the key
size (N + P = 192) and the output sliced back: the padded columns add nothing to the result. The
keys and values of every cached position are expanded from the latents first (cuDNN reads per-head
keys), so this path holds them for the whole cache, though never the [T, S] scores.

cuDNN's causal mask is aligned at the top left (query i sees keys 0..i of its own segment), and its
padding mask hides keys from the END of a row. A chunk at offset o (queries o..o+T-1, keys 0..S-1)
is therefore two calls merged by their log-sum-exps: the chunk's own keys o..o+T-1 causally, and the
cached keys 0..o-1 unmasked (a key length o per row). Left padding would need a mask from the START
of a row, which this API has no form of: such problems go to another implementation (see dispatch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla.reference import expand_keys_values

F32 = jnp.float32


def _attend(q, k, v, scale, implementation, **mask) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, H, N + P], log-sum-exp [B, T, H] fp32) of one dot_product_attention call."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation,
                                        return_residual=True, **mask)


def segmented_mla_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                            q_offset: int | jax.Array = 0, start: jax.Array | None = None,
                            implementation: str = "cudnn") -> jax.Array:
    """-> [B, T, H, V]. `implementation` "xla" runs the same segments with XLA's attention (tests on CPU)."""
    if start is not None:
        raise ValueError("segmented_mla_attention: left padding (start) has no cuDNN mask; use the blockwise path")
    batch, seq, heads, qk_dim = q.shape
    value_dim = w_kv_b.shape[0] // heads - nope_dim

    def keys_values(lat: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, v = expand_keys_values(lat, w_kv_b, heads, nope_dim, q.dtype)
        return k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - value_dim)))

    own = jax.lax.dynamic_slice_in_dim(latents, q_offset, seq, axis=1)
    out, lse = _attend(q, *keys_values(own), scale, implementation, is_causal=True)
    if isinstance(q_offset, int) and q_offset == 0:
        return out[..., :value_dim]
    past_len = jnp.full((batch,), q_offset, jnp.int32)
    past, past_lse = _attend(q, *keys_values(latents), scale, implementation,
                             key_value_seq_lengths=jnp.maximum(past_len, 1))
    lse, past_lse = lse.astype(F32), jnp.where(q_offset > 0, past_lse.astype(F32), -jnp.inf)
    top = jnp.maximum(lse, past_lse)
    w_own, w_past = jnp.exp(lse - top)[..., None], jnp.exp(past_lse - top)[..., None]
    merged = (w_own * out.astype(F32) + w_past * past.astype(F32)) / (w_own + w_past)
    return merged[..., :value_dim].astype(q.dtype)
