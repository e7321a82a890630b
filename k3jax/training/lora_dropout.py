"""LoRA dropout: per-module PRNG key state the trainer refreshes every step, so the forward stays a pure
function of the model (shared by the projection adapters and the routed-expert adapters)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class LoRADropoutKey(nnx.Variable):
    """Raw PRNG key data (uint32 [..., 2], one key per stacked layer) for a LoRA module's dropout."""


def lora_dropout(x: jax.Array, key_data: jax.Array, rate: float, salt: int = 0) -> jax.Array:
    """Inverted dropout of an adapter's input at `rate`, drawn from `key_data` folded with `salt`."""
    key = jax.random.wrap_key_data(key_data)
    if salt:
        key = jax.random.fold_in(key, salt)
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def refresh_dropout_keys(keys: object, step_key: jax.Array) -> object:
    """New dropout key data for every `LoRADropoutKey` leaf of a state tree (distinct per leaf and layer)."""
    leaves, treedef = jax.tree.flatten(keys)
    fresh = []
    for i, leaf in enumerate(leaves):
        n = max(1, math.prod(leaf.shape) // 2)
        data = jax.random.key_data(jax.random.split(jax.random.fold_in(step_key, i), n))
        fresh.append(data.reshape(leaf.shape).astype(jnp.uint32))
    return jax.tree.unflatten(treedef, fresh)
