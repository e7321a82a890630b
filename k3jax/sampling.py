"""Token samplers: greedy, temperature, top-k and top-p (nucleus), as pure functions on logits [B, V].

Everything here is jit-friendly; the sampling settings are Python values (static under jit), the
logits and the PRNG key are arrays. The order of the filters is the usual one (as in HF
transformers): divide by the temperature, keep the top k, then keep the nucleus of what remains.

    logits = sampling_logits(logits, temperature=0.8, top_k=50, top_p=0.95)   # -inf outside the support
    tokens = sample(logits, key, temperature=0.8, top_k=50, top_p=0.95)       # int32 [B]

Temperature 0 is greedy (argmax; top-k and top-p cannot change the argmax, so they are ignored).
Ties: top-k keeps every token whose logit equals the k-th largest, top-p every token whose
probability equals the smallest one in the nucleus, so equal logits are always treated alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def _is_real(value: object) -> bool:
    """A Python or numpy int / float, not a bool (True would pass for 1)."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))


@dataclass(frozen=True)
class SamplingParams:
    """Hashable sampler settings (a static argument under jit)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        """Check the settings before any cast (NaN, bools and fractional top_k are errors) and store
        them as Python float / int, so equal settings hash alike and share one compiled program."""
        if not _is_real(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number >= 0 (0 is greedy)")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 1
        ):
            raise ValueError(f"top_k={self.top_k!r}: expected a positive integer or None")
        if self.top_p is not None and (not _is_real(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: expected 0 < top_p <= 1 or None")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", None if self.top_k is None else int(self.top_k))
        object.__setattr__(self, "top_p", None if self.top_p is None else float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """-inf everywhere but the k largest logits of each row (ties with the k-th largest are kept)."""
    logits = logits.astype(F32)
    if k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
    """-inf outside the nucleus: the fewest most-probable tokens whose probabilities sum to >= p.

    A token is in the nucleus when the mass of the tokens strictly more probable than it (in sorted
    order) is < p, so the most probable token is always kept and p = 1 keeps everything.
    """
    logits = logits.astype(F32)
    if p >= 1:
        return logits
    probs = jax.nn.softmax(logits, axis=-1)
    desc = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(desc, axis=-1) - desc  # mass ahead of each sorted token
    count = jnp.sum(before < p, axis=-1, keepdims=True)  # >= 1: before[0] == 0 < p
    threshold = jnp.take_along_axis(desc, count - 1, axis=-1)  # smallest probability in the nucleus
    return jnp.where(probs < threshold, -jnp.inf, logits)


def sampling_logits(
    logits: jax.Array, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> jax.Array:
    """fp32 logits whose softmax is the distribution `sample` draws from (temperature > 0)."""
    if temperature <= 0:
        raise ValueError("sampling_logits needs temperature > 0 (temperature 0 is greedy: use sample)")
    out = logits.astype(F32) / temperature
    if top_k is not None:
        out = top_k_mask(out, top_k)
    if top_p is not None:
        out = top_p_mask(out, top_p)
    return out


def sample(
    logits: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """One token per row of logits [B, V]: int32 [B]. Rows draw independently from one key."""
    params = SamplingParams(temperature, top_k, top_p)  # validates
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = sampling_logits(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def sample_with(params: SamplingParams, logits: jax.Array, key: jax.Array) -> jax.Array:
    """`sample` with the settings of `params`."""
    return sample(logits, key, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
