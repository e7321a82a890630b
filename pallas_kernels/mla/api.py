"""Public entry of MLA prefill attention: input checks, then the implementation ``dispatch.py`` chooses.

``implementation`` names a table entry ("cudnn", "xla") or is None for the policy (see
``dispatch.py``).
"""

from __future__ import annotations

import jax

from pallas_kernels.dispatch import choose
from pallas_kernels.mla.dispatch import IMPLEMENTATIONS
from pallas_kernels.mla.reference import continues_cache


def mla_prefill_attention(q: jax.Array, latents: jax.Array, w_kv_b: jax.Array, *, nope_dim: int, scale: float,
                          q_offset: int | jax.Array = 0, start: jax.Array | None = None,
                          segment_ids: jax.Array | None = None, context_split: bool = False,
                          implementation: str | None = None) -> jax.Array:
    """Causal attention of T new queries over the latents of positions 0..S-1 -> [B, T, H, V].

    q [B, T, H, N + P] at positions q_offset..q_offset+T-1 (q_offset + T <= S); latents [B, S, R + P];
    w_kv_b [H * (N + V), R] (kv_b_proj's weight); start int32 [B] or None: left padding before it;
    segment_ids int32 [B, S] or None: packed documents of a cache-free pass (see ``reference.py`` for
    the mask); context_split: the latents are sharded along S over a mesh axis (context parallelism),
    which only the blockwise op takes."""
    if q.ndim != 4 or latents.ndim != 3 or w_kv_b.ndim != 2:
        raise ValueError(f"mla_prefill_attention: expected q [B, T, H, N + P], latents [B, S, R + P], "
                         f"w_kv_b [H * (N + V), R]; got {q.shape}, {latents.shape}, {w_kv_b.shape}")
    batch, seq, heads, qk_dim = q.shape
    rank = w_kv_b.shape[1]
    rope = latents.shape[2] - rank
    if latents.shape[0] != batch or rope < 0 or nope_dim + rope != qk_dim:
        raise ValueError(f"mla_prefill_attention: latents {latents.shape} (R = {rank} from w_kv_b) do not match "
                         f"q {q.shape} with nope_dim={nope_dim}: expected latents [{batch}, S, {rank} + "
                         f"{qk_dim - nope_dim}]")
    if w_kv_b.shape[0] % heads or w_kv_b.shape[0] // heads <= nope_dim:
        raise ValueError(f"mla_prefill_attention: w_kv_b rows {w_kv_b.shape[0]} are not {heads} heads x "
                         f"(nope_dim={nope_dim} + V)")
    if latents.shape[1] < seq:
        raise ValueError(f"mla_prefill_attention: {seq} queries but only {latents.shape[1]} latent positions")
    if start is not None and start.shape != (batch,):
        raise ValueError(f"mla_prefill_attention: start must be int32 [{batch}], got {start.shape}")
    cached = continues_cache(q_offset, seq, latents.shape[1])
    if segment_ids is not None and (cached or segment_ids.shape != (batch, seq)):
        raise ValueError(f"mla_prefill_attention: segment_ids are for a whole cache-free sequence: expected "
                         f"[{batch}, {seq}] with no q_offset, got {segment_ids.shape} (latents {latents.shape})")
    impl = choose("mla_prefill_attention", IMPLEMENTATIONS, implementation, cached=cached,
                  left_padding=start is not None, segments=segment_ids is not None, context_split=context_split,
                  dtype=q.dtype, qk_dim=qk_dim, mask_elements=batch * seq * latents.shape[1],
                  expanded_bytes=batch * latents.shape[1] * heads * 2 * qk_dim * q.dtype.itemsize)
    extra = {} if segment_ids is None else {"segment_ids": segment_ids}
    return impl.run(q, latents, w_kv_b, nope_dim=nope_dim, scale=scale, q_offset=q_offset, start=start, **extra)
