"""Router-bias updates outside the gradient: Quantile Balancing, and the fixed-step rule it replaces.

Quantile Balancing (k3-architecture.md §5): the new bias of expert j is the k/n quantile of
r_ij = alpha_i - s_ij over the step's tokens (the value that lets exactly m*k/n tokens clear their
cutoff for j), read from the per-expert histogram `k3jax.nn.moe.router_stats` accumulates (one
sum over micro-batches and data shards: under `jax.jit` the batch-sharded sum is GSPMD's one
all-reduce), interpolated inside its bin, then mean-centred. It replaces the old bias: no step
size. `sign_balance_update` is DeepSeek-V3's auxiliary-loss-free rule, kept as the baseline.
All functions take stacked leading axes (scanned layer groups) and work on the last axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.nn.moe import BALANCE_BINS

F32 = jnp.float32


def quantile_balance(histogram: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """New bias [..., E] from the summed histogram [..., E, BALANCE_BINS] built under `bias`.

    Steps without tokens keep the old bias."""
    num_experts = bias.shape[-1]
    counts = histogram.astype(F32)
    total = jnp.sum(counts, axis=-1)  # [..., E]: every expert sees every token
    rank = total * (top_k / num_experts)  # the target load q = m k / n
    cumulative = jnp.cumsum(counts, axis=-1)
    first = jnp.argmax(cumulative >= rank[..., None], axis=-1)  # first bin reaching the rank
    in_bin = jnp.take_along_axis(counts, first[..., None], axis=-1)[..., 0]
    before = jnp.take_along_axis(cumulative, first[..., None], axis=-1)[..., 0] - in_bin
    position = first.astype(F32) + (rank - before) / jnp.maximum(in_bin, 1.0)  # fractional bin
    width = (jnp.max(bias, axis=-1, keepdims=True) - jnp.min(bias, axis=-1, keepdims=True) + 2.0) / BALANCE_BINS
    new = (position - jnp.mean(position, axis=-1, keepdims=True)) * width  # the lower edge cancels
    return jnp.where(total > 0, new, bias).astype(bias.dtype)


def sign_balance_update(load: jax.Array, bias: jax.Array, rate: float) -> jax.Array:
    """Auxiliary-loss-free update: b += rate * sign(mean(load) - load), mean-centred."""
    load = load.astype(F32)
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (bias + step - jnp.mean(step, axis=-1, keepdims=True)).astype(bias.dtype)


def load_imbalance(load: jax.Array) -> jax.Array:
    """max(load) / mean(load) over the experts (last axis): 1 is perfectly balanced."""
    load = load.astype(F32)
    return jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
