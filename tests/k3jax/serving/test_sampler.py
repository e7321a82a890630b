"""A request's step keys are exactly `jax.random.split(key(seed), max_tokens)`, as `k3jax.generate`
draws them, although the engine splits for the count rounded up to a power of two."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from k3jax.serving.sampler import request_keys


@pytest.mark.parametrize("count", [1, 2, 3, 17, 64, 65])
def test_keys_are_the_exact_split(count):
    for seed in (0, 2**32 - 1):
        expected = jax.random.key_data(jax.random.split(jax.random.key(seed), count))
        np.testing.assert_array_equal(request_keys(seed, count), expected)
