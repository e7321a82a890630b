"""Gated NoPE MLA: DeepSeek multi-head latent attention without rotary embeddings, with a sigmoid output gate.

The 'rope' dims are concatenated unrotated; k_pe is one key part shared by all heads and is not
normalised; scale (nope + rope)^-0.5; o *= sigmoid(g_proj x) before o_proj (k3-architecture.md §6.1).
The cache holds the per-token latent (normalised c_kv || k_pe). Prefill (and the forward without a
cache) runs `pallas_kernels.mla.mla_prefill_attention`, which expands per-head keys/values from the
latents and attends flash-style (no [T, S] scores; implementation from `Kernels.mla`); single-token
decode runs in the absorbed form: W_UK folded into the query, W_UV applied after attending over the
latents (`pallas_kernels.mla.absorbed_attention`). Softmax and scores are fp32.

Context parallelism: when `sharding.shard_model` / `enable_context_parallelism` has given the layer a
`ContextParallel` whose axis splits the cache's positions, decode runs
`sharding.context_parallel_absorbed_attention` under shard_map (each device attends over its own
positions; one all-gather per layer merges the partials). Prefill stays with GSPMD, on the blockwise
op unless `Kernels.mla` names another.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import MLA_LOW_RANK_NORM_EPS, K3Config
from k3jax.kernels import Kernels
from k3jax.nn.layers import F32, HIGHEST, Linear, RMSNorm
from pallas_kernels.mla import absorbed_attention, mla_prefill_attention
from sharding.context_parallel import ContextParallel


class MLACache(NamedTuple):
    latent: jax.Array  # [B, S, kv_lora_rank + qk_rope_head_dim], activation dtype

    LOGICAL_AXES = {"latent": ("activation_batch", "cache_length", None)}  # read by `sharding`

    @classmethod
    def empty(cls, cfg: K3Config, batch: int, capacity: int, dtype: jnp.dtype) -> "MLACache":
        return cls(jnp.zeros((batch, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype))


class GatedMLA(nnx.Module):
    def __init__(self, cfg: K3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs, kernels: Kernels = Kernels()) -> None:
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
        self.kernels = kernels  # static: which MLA prefill attention runs
        # Set by `sharding.shard_model` when the mesh splits the cache's positions (`cache_length`):
        # decode then runs context-parallel under shard_map (sharding/context_parallel.py).
        self.context_parallel: ContextParallel | None = None

    def __call__(
        self, x: jax.Array, cache: MLACache | None = None, position: jax.Array | int = 0,
        start: jax.Array | None = None, segments: jax.Array | None = None,
    ) -> tuple[jax.Array, MLACache | None]:
        """x [B, T, D]. With a cache, the T new tokens sit at positions [position, position + T).

        `start` int32 [B]: keys before start[b] are left padding and hidden from row b (a pad query
        still sees itself, so no softmax row is empty; `pallas_kernels.mla.attention_mask`).
        `segments` int32 [B, T] (packed documents, no cache): a query sees only keys with its
        segment id (K3 has no positional encoding, so a document needs no position reset).
        """
        if segments is not None and cache is not None:
            raise ValueError("segments (packed documents) are for cache-free passes; got a cache too")
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(batch, seq, self.num_heads, -1)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = jnp.concatenate([self.kv_a_layernorm(ckv[..., : self.kv_lora_rank]), ckv[..., self.kv_lora_rank :]], -1)

        if cache is None:
            latents = latent
        else:
            latents = jax.lax.dynamic_update_slice_in_dim(cache.latent, latent.astype(cache.latent.dtype), position, 1)
        if cache is not None and seq == 1:
            o = self._attend_absorbed(q, latents, position, start)
        else:
            # Without a cache the queries are the whole sequence: offset 0, known statically.
            offset = position if cache is not None else 0
            # A cache split over a context axis reaches this call sharded along its positions.
            o = mla_prefill_attention(q, latents.astype(q.dtype), self.kv_b_proj.weight[...],
                                      nope_dim=self.nope_dim, scale=self.scale, q_offset=offset, start=start,
                                      segment_ids=segments, context_split=self.context_parallel is not None,
                                      implementation=self.kernels.mla)
        o = o.reshape(batch, seq, self.num_heads * self.v_dim)
        o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o), (MLACache(latents) if cache is not None else None)

    def _attend_absorbed(self, q: jax.Array, latents: jax.Array, position: jax.Array | int,
                         start: jax.Array | None) -> jax.Array:
        """Attention in latent space: scores q_nope W_UK . c + q_pe . k_pe; output (p . c) W_UV^T. fp32."""
        w = self.kv_b_proj.weight[...].astype(F32).reshape(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q32 = q.astype(F32)
        q_latent = jnp.einsum("bthd,hdr->bthr", q32[..., : self.nope_dim], w_uk, precision=HIGHEST)
        q_pe = q32[..., self.nope_dim :]
        if self.context_parallel is not None and self.context_parallel.splits(latents.shape[1]):
            o = self.context_parallel.attend(q_latent, q_pe, latents, w_uv, scale=self.scale, position=position,
                                             start=start)
            return o.astype(q.dtype)
        query_pos = position + jnp.arange(q.shape[1])
        o_latent = absorbed_attention(q_latent, q_pe, latents, scale=self.scale, query_pos=query_pos, start=start)
        return jnp.einsum("bthr,hvr->bthv", o_latent, w_uv, precision=HIGHEST).astype(q.dtype)
