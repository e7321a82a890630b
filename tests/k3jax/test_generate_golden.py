"""Cached inference against the reference's own greedy loop (KimiDynamicCache) on k3-tiny-a, fp32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from tests.conftest import rel_rms


@pytest.fixture(scope="module")
def reference(golden_reference):
    return golden_reference("generate_fp32")


def test_greedy_generation_is_identical(golden_model_fp32, reference):
    new = k3jax.generate(golden_model_fp32, jnp.asarray(reference["prompt_ids"]), max_new_tokens=12)
    assert new.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(new), reference["new_ids"])


def test_prefill_and_step_logits(golden_model_fp32, reference):
    """Logits of the prefill and of each cached step, fed the reference's tokens (teacher forcing)."""
    prompt, new_ids = jnp.asarray(reference["prompt_ids"]), reference["new_ids"]
    logits, cache = k3jax.prefill(golden_model_fp32, prompt, capacity=prompt.shape[1] + new_ids.shape[1],
                                  return_all_logits=True)
    assert rel_rms(logits[0], reference["prefill_logits"]) <= 1e-4
    steps = [np.asarray(logits[0, -1])]
    for token in new_ids[0, :-1]:
        step_logits, cache = k3jax.decode_step(golden_model_fp32, cache, jnp.asarray([token]))
        steps.append(np.asarray(step_logits[0]))
    assert rel_rms(np.stack(steps), reference["step_logits"]) <= 1e-4
    assert np.abs(np.stack(steps) - reference["step_logits"]).max() <= 1e-3
