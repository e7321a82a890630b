"""Per-row sampling for a batch whose rows are different requests, each with its own settings and key.

`k3jax.sampling` takes one static setting for the whole batch and one key for all rows; a serving
batch mixes requests, so here temperature, top-k and top-p are arrays [B] and every row draws with
its own key. Row b computes what `k3jax.sampling.sample` computes for that row alone (batch 1, the
same key): the same filters in the same order (temperature, top-k, nucleus), the same ties, and the
same Gumbel draw, so a seeded request samples the tokens `k3jax.generate` samples for it alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


class RowParams(NamedTuple):
    """Per-row sampler settings (host arrays [B]): temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int32
    top_p: np.ndarray  # float32

    @classmethod
    def of(cls, rows: list[tuple[float, int | None, float | None]]) -> "RowParams":
        return cls(
            np.asarray([t for t, _, _ in rows], np.float32),
            np.asarray([k or 0 for _, k, _ in rows], np.int32),
            np.asarray([1.0 if p is None else p for _, _, p in rows], np.float32),
        )


def _filtered(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """One row [V]: logits / temperature, then -inf outside the top-k and outside the nucleus."""
    out = logits.astype(F32) / temperature
    vocab = out.shape[-1]
    kth = jnp.sort(out)[::-1][jnp.clip(top_k - 1, 0, vocab - 1)]  # the k-th largest (ties kept, as lax.top_k)
    out = jnp.where((top_k > 0) & (top_k < vocab) & (out < kth), -jnp.inf, out)
    probs = jax.nn.softmax(out)
    desc = -jnp.sort(-probs)
    before = jnp.cumsum(desc) - desc  # mass ahead of each sorted token
    count = jnp.sum(before < top_p)
    threshold = desc[count - 1]  # smallest probability in the nucleus
    return jnp.where((top_p < 1) & (probs < threshold), -jnp.inf, out)


def sample_rows(logits: jax.Array, keys: jax.Array, params: RowParams, *, any_sampling: bool) -> jax.Array:
    """logits [B, V] fp32, keys uint32 key data [B, 2] -> int32 [B]. `any_sampling` (static): whether
    any row has temperature > 0 (else the argmax alone, no sort)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not any_sampling:
        return greedy
    temperature = jnp.asarray(params.temperature)

    def draw(row, key, t, k, p):
        filtered = _filtered(row, jnp.where(t > 0, t, 1.0), k, p)
        # [1, V] as `sample` sees a batch-1 row, so the Gumbel noise is the same
        return jax.random.categorical(jax.random.wrap_key_data(key), filtered[None], axis=-1)[0].astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, keys, temperature, jnp.asarray(params.top_k), jnp.asarray(params.top_p))
    return jnp.where(temperature > 0, drawn, greedy)


def request_keys(seed: int, count: int) -> np.ndarray:
    """The key data [count, 2] of a request's steps: step i draws with the i-th of
    `jax.random.split(jax.random.key(seed), count)`, as `k3jax.generate` does. With JAX's default
    PRNG (partitionable threefry) the i-th key of a split does not depend on the count, so the split
    is taken for the count rounded up to a power of two: one program per power, not one compile on
    the engine thread for every new `max_tokens`."""
    total = count
    if jax.config.jax_threefry_partitionable and jax.config.jax_default_prng_impl == "threefry2x32":
        total = 1 << (count - 1).bit_length()
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), total)))[:count]
