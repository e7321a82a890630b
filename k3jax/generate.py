"""Inference with a cache: prefill, single-token decode steps, and a greedy/temperature generate loop.

The cache holds, per KDA layer, the fp32 recurrent state and the last W-1 raw conv inputs, and per
MLA layer the latents of every position up to its capacity (see `ModelCache`). `decode_step` is the
same forward pass on one token per sequence: KDA takes its recurrent step, MLA attends in the
absorbed form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.model import K3Model, ModelCache, _check_ids, run_model


@functools.partial(jax.jit, static_argnames=("capacity",))
def _prefill(model: K3Model, ids: jax.Array, capacity: int) -> tuple[jax.Array, ModelCache]:
    cache = model.empty_cache(ids.shape[0], capacity)
    out, cache = run_model(model, ids, cache)
    return out.logits, cache


def prefill(model: K3Model, input_ids: jax.Array, *, capacity: int | None = None) -> tuple[jax.Array, ModelCache]:
    """Run the prompt [B, T] and return (logits [B, T, vocab] fp32, cache with room for `capacity` tokens)."""
    ids = _check_ids(input_ids, model.config)
    capacity = capacity if capacity is not None else ids.shape[1]
    if capacity < ids.shape[1]:
        raise ValueError(f"capacity={capacity} is smaller than the prompt length {ids.shape[1]}")
    return _prefill(model, ids, capacity)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _decode_step(model: K3Model, cache: ModelCache, tokens: jax.Array) -> tuple[jax.Array, ModelCache]:
    out, cache = run_model(model, tokens[:, None], cache)
    return out.logits[:, 0], cache


def decode_step(model: K3Model, cache: ModelCache, tokens: jax.Array) -> tuple[jax.Array, ModelCache]:
    """Append one token per sequence (int32 [B]); returns (logits [B, vocab] fp32, updated cache).

    The cache passed in is donated (its buffers are reused); use the returned one.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be int32 [batch]; got shape {tokens.shape}")
    if int(cache.length) >= cache.capacity:
        raise ValueError(f"the cache is full: it holds {cache.capacity} tokens; prefill with a larger capacity")
    return _decode_step(model, cache, tokens.astype(jnp.int32))


def _pick(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "temperature"))
def _generate(model: K3Model, ids: jax.Array, key: jax.Array, max_new_tokens: int, temperature: float) -> jax.Array:
    cache = model.empty_cache(ids.shape[0], ids.shape[1] + max_new_tokens)
    out, cache = run_model(model, ids, cache)
    keys = jax.random.split(key, max_new_tokens)
    first = _pick(out.logits[:, -1], temperature, keys[0])

    def step(carry, step_key):
        token, cache = carry
        step_out, cache = run_model(model, token[:, None], cache)
        next_token = _pick(step_out.logits[:, 0], temperature, step_key)
        return (next_token, cache), next_token

    _, rest = jax.lax.scan(step, (first, cache), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(
    model: K3Model, input_ids: jax.Array, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> jax.Array:
    """Continue each prompt by `max_new_tokens` tokens: int32 [B, N]. Greedy at temperature 0."""
    ids = _check_ids(input_ids, model.config)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected at least 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: expected >= 0")
    return _generate(model, ids, jax.random.key(seed), max_new_tokens, float(temperature))
