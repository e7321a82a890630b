"""Gated NoPE MLA: DeepSeek multi-head latent attention without rotary embeddings, with a sigmoid output gate.

The 'rope' dims are concatenated unrotated; k_pe is one key part shared by all heads and is not
normalised; scale (nope + rope)^-0.5; o *= sigmoid(g_proj x) before o_proj (k3-architecture.md §6.1).
The cache holds the per-token latent (normalised c_kv || k_pe), and single-token decode runs in the
absorbed form: W_UK folded into the query, W_UV applied after attending over the latents.
Softmax and scores are fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MLA_LOW_RANK_NORM_EPS, K3Config
from k3jax.nn.layers import F32, HIGHEST, Linear, RMSNorm
from pallas_kernels.precision import exact_if_fp32


QUERY_CHUNK = 1024  # prefill query rows attended at once (bounds the [heads, rows, keys] fp32 scores)


def _attention_mask(query_pos: jax.Array, key_pos: jax.Array, start: jax.Array | None) -> jax.Array:
    """Causal mask [T, S] (also hides unwritten cache rows); with left padding (`start` [B], first real
    position per row) [B, 1, T, S], pads hidden except from themselves so no softmax row is empty."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if start is None:
        return mask
    real = (key_pos[None, None, :] >= start[:, None, None]) | (key_pos[None, :] == query_pos[:, None])
    return (mask & real)[:, None]


class MLACache(NamedTuple):
    latent: jax.Array  # [B, S, kv_lora_rank + qk_rope_head_dim], activation dtype

    LOGICAL_AXES = {"latent": ("activation_batch", "cache_length", None)}  # read by `sharding`

    @classmethod
    def empty(cls, cfg: K3Config, batch: int, capacity: int, dtype: jnp.dtype) -> "MLACache":
        return cls(jnp.zeros((batch, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype))


class GatedMLA(nnx.Module):
    def __init__(self, cfg: K3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, h = cfg.hidden_size, cfg.mla_num_heads
        self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype=dtype, axes=("q_lora", "embed"), rngs=rngs)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_LOW_RANK_NORM_EPS, dtype=dtype, axis="q_lora", rngs=rngs)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype=dtype, axes=("mla_proj", "q_lora"), rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(
            d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, axes=("kv_lora", "embed"), rngs=rngs
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, MLA_LOW_RANK_NORM_EPS, dtype=dtype, axis="kv_lora", rngs=rngs)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype,
            axes=("mla_proj", "kv_lora"), rngs=rngs,
        )
        self.g_proj = Linear(d, h * cfg.v_head_dim, dtype=dtype, axes=("mla_proj", "embed"), rngs=rngs)
        self.o_proj = Linear(h * cfg.v_head_dim, d, dtype=dtype, axes=("embed", "mla_proj"), rngs=rngs)
        self.num_heads, self.kv_lora_rank = h, cfg.kv_lora_rank
        self.nope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim**-0.5
        self.query_chunk = QUERY_CHUNK

    def __call__(
        self, x: jax.Array, cache: MLACache | None = None, position: jax.Array | int = 0,
        start: jax.Array | None = None, segments: jax.Array | None = None,
    ) -> tuple[jax.Array, MLACache | None]:
        """x [B, T, D]. With a cache, the T new tokens sit at positions [position, position + T).

        `start` int32 [B]: keys before start[b] are left padding and hidden from row b (a pad query
        still sees itself, so no softmax row is empty). `segments` int32 [B, T] (packed documents,
        no cache): a query sees only keys with its segment id (K3 has no positional encoding, so a
        document needs no position reset).
        """
        if segments is not None and cache is not None:
            raise ValueError("segments (packed documents) are for cache-free passes; got a cache too")
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(batch, seq, self.num_heads, -1)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = jnp.concatenate([self.kv_a_layernorm(ckv[..., : self.kv_lora_rank]), ckv[..., self.kv_lora_rank :]], -1)

        query_pos = position + jnp.arange(seq)
        if cache is None:
            latents, key_pos = latent, jnp.arange(seq)
        else:
            latents = jax.lax.dynamic_update_slice_in_dim(cache.latent, latent.astype(cache.latent.dtype), position, 1)
            key_pos = jnp.arange(latents.shape[1])
        if cache is not None and seq == 1:
            o = self._attend_absorbed(q, latents, _attention_mask(query_pos, key_pos, start))
        else:
            o = self._attend_expanded(q, latents, query_pos, key_pos, start, segments)
        o = o.reshape(batch, seq, self.num_heads * self.v_dim)
        o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o), (MLACache(latents) if cache is not None else None)

    def _attend_expanded(
        self, q: jax.Array, latents: jax.Array, query_pos: jax.Array, key_pos: jax.Array, start: jax.Array | None,
        segments: jax.Array | None = None,
    ) -> jax.Array:
        """Per-head keys/values re-expanded from the latents with kv_b_proj (prefill).

        Queries go in chunks of `query_chunk` rows, so the fp32 scores and the mask are [chunk, S]
        rather than [T, S] (a 128K prompt would otherwise need [heads, T, T] scores). Each row's
        softmax still sees all its keys, so chunking does not change the result."""
        batch, keys, _ = latents.shape
        kv = self.kv_b_proj(latents[..., : self.kv_lora_rank].astype(q.dtype)).reshape(batch, keys, self.num_heads, -1)
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        k_pe = jnp.broadcast_to(latents[:, :, None, self.kv_lora_rank :].astype(q.dtype), (*k_nope.shape[:3], q.shape[-1] - self.nope_dim))
        k = jnp.concatenate([k_nope, k_pe], axis=-1)

        def attend(q_rows: jax.Array, rows_pos: jax.Array, rows_seg: jax.Array | None = None) -> jax.Array:
            scores = jnp.einsum("bthd,bshd->bhts", q_rows, k, preferred_element_type=F32,
                                precision=exact_if_fp32(q.dtype)) * self.scale
            mask = _attention_mask(rows_pos, key_pos, start)
            if rows_seg is not None:
                mask = mask & (rows_seg[:, None, :, None] == segments[:, None, None, :])
            probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(q.dtype)
            return jnp.einsum("bhts,bshd->bthd", probs, v, preferred_element_type=F32,
                              precision=exact_if_fp32(q.dtype)).astype(q.dtype)

        seq, chunk = q.shape[1], self.query_chunk
        if seq <= chunk:
            return attend(q, query_pos, segments)
        pad = -seq % chunk
        q_chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(batch, -1, chunk, *q.shape[2:])
        pos_chunks = jnp.pad(query_pos, (0, pad), mode="edge").reshape(-1, chunk)
        xs = (jnp.moveaxis(q_chunks, 1, 0), pos_chunks)
        if segments is not None:
            seg_chunks = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge").reshape(batch, -1, chunk)
            xs = (*xs, jnp.moveaxis(seg_chunks, 1, 0))
        out = jax.lax.map(lambda args: attend(*args), xs)
        return jnp.moveaxis(out, 0, 1).reshape(batch, seq + pad, *out.shape[3:])[:, :seq]

    def _attend_absorbed(self, q: jax.Array, latents: jax.Array, mask: jax.Array) -> jax.Array:
        """Attention in latent space: scores q_nope W_UK . c + q_pe . k_pe; output (p . c) W_UV^T. fp32."""
        w = self.kv_b_proj.weight[...].astype(F32).reshape(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q32 = q.astype(F32)
        c = latents[..., : self.kv_lora_rank].astype(F32)
        k_pe = latents[..., self.kv_lora_rank :].astype(F32)
        q_latent = jnp.einsum("bthd,hdr->bthr", q32[..., : self.nope_dim], w_uk, precision=HIGHEST)
        scores = jnp.einsum("bthr,bsr->bhts", q_latent, c, precision=HIGHEST)
        scores = scores + jnp.einsum("bthd,bsd->bhts", q32[..., self.nope_dim :], k_pe, precision=HIGHEST)
        probs = jax.nn.softmax(jnp.where(mask, scores * self.scale, -jnp.inf), axis=-1)
        o_latent = jnp.einsum("bhts,bsr->bthr", probs, c, precision=HIGHEST)
        return jnp.einsum("bthr,hvr->bthv", o_latent, w_uv, precision=HIGHEST).astype(q.dtype)
