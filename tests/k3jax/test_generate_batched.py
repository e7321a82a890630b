"""Batched generation on k3-tiny-a (fp32): left-padded prompts of different lengths, stop tokens,
the capacity check, streaming and sampler settings.

Reference for "the sequence run alone": one forward pass without a cache over the prompts followed
by their generated tokens, RIGHT-padded into one batch. The model is causal, so whatever follows a
row's tokens cannot change its logits, and no masking is involved: each row's prefix is exactly that
sequence alone (checked literally for the shortest prompt too). The padded path differs from it only
by fp32 operation order (chunked KDA with other chunk boundaries, absorbed vs expanded MLA), ~1e-6.

Compiles are the cost here (~15 s each on 2 cores): every test reuses the shapes of the first
(prompt width 70, capacity 75), so the jitted prefill, decode step and generate scan compile once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.generate import left_pad, prefill
from tests.conftest import rel_rms

LENGTHS = (3, 17, 70)
NEW = 6
PAD = 511


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 511, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def padded(prompts):
    return left_pad(prompts, PAD)


@pytest.fixture(scope="module")
def batched(golden_model_fp32, padded):
    ids, lengths = padded
    return k3jax.generate(
        golden_model_fp32, ids, prompt_lengths=lengths, max_new_tokens=NEW, return_lengths=True
    )


@pytest.fixture(scope="module")
def alone(golden_model_fp32, prompts, batched):
    """Logits of each prompt + its generated tokens, run as one right-padded cacheless batch."""
    full = [p + np.asarray(batched.tokens[b]).tolist() for b, p in enumerate(prompts)]
    ids = np.zeros((len(full), max(map(len, full))), np.int32)
    for b, f in enumerate(full):
        ids[b, : len(f)] = f
    return full, np.asarray(k3jax.forward(golden_model_fp32, jnp.asarray(ids)).logits)


def test_left_pad():
    ids, lengths = left_pad([[1, 2], [3], [4, 5, 6]], pad_token_id=9)
    np.testing.assert_array_equal(ids, [[9, 1, 2], [9, 9, 3], [4, 5, 6]])
    np.testing.assert_array_equal(lengths, [2, 1, 3])
    with pytest.raises(ValueError):
        left_pad([[1], []])


def test_mixed_batch_greedy_equals_alone(batched, alone):
    """Greedy tokens of each row == argmax of the row's own logits at every step (teacher forcing
    with the batch's tokens), i.e. the tokens the sequence generates alone."""
    tokens = np.asarray(batched.tokens)
    assert tokens.dtype == np.int32 and tokens.shape == (len(LENGTHS), NEW)
    np.testing.assert_array_equal(batched.lengths, [NEW] * len(LENGTHS))
    _, ref = alone
    for b, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(tokens[b], ref[b, n - 1 : n - 1 + NEW].argmax(-1), err_msg=f"row {b}")


def test_mixed_batch_logits_equal_alone(golden_model_fp32, padded, batched, alone):
    """Prefill logits at the real positions and every decode step's logits, left-padded batch vs alone."""
    ids, lengths = padded
    _, ref = alone
    logits, cache = prefill(golden_model_fp32, ids, capacity=ids.shape[1] + NEW - 1, prompt_lengths=lengths,
                            return_all_logits=True)
    steps = [np.asarray(logits[:, -1])]
    for i in range(NEW - 1):
        step_logits, cache = k3jax.decode_step(golden_model_fp32, cache, batched.tokens[:, i])
        steps.append(np.asarray(step_logits))
    steps = np.stack(steps, axis=1)
    width = ids.shape[1]
    for b, n in enumerate(LENGTHS):
        assert rel_rms(logits[b, width - n :], ref[b, :n]) <= 1e-5, f"prefill, row {b}"
        assert rel_rms(steps[b], ref[b, n - 1 : n - 1 + NEW]) <= 1e-5, f"decode steps, row {b}"


def test_shortest_row_equals_its_own_unbatched_forward(golden_model_fp32, alone):
    full, ref = alone
    own = np.asarray(golden_model_fp32(jnp.asarray([full[0]])))[0]
    assert rel_rms(ref[0, : len(full[0])], own) <= 1e-5


def _expected_with_stops(tokens: np.ndarray, stops: set[int]) -> tuple[np.ndarray, np.ndarray]:
    out, lengths = tokens.copy(), np.full(tokens.shape[0], tokens.shape[1])
    for b in range(tokens.shape[0]):
        hits = [i for i, t in enumerate(tokens[b]) if t in stops]
        if hits:
            out[b, hits[0] + 1 :] = PAD
            lengths[b] = hits[0] + 1
    return out, lengths


def test_stop_tokens_scan_and_streamed(golden_model_fp32, padded, batched):
    ids, lengths = padded
    tokens = np.asarray(batched.tokens)
    stops = {int(tokens[1, 2]), int(tokens[0, 4])}
    expected, expected_lengths = _expected_with_stops(tokens, stops)
    assert expected_lengths.min() < NEW  # the test stops something
    kwargs = dict(prompt_lengths=lengths, max_new_tokens=NEW, stop_tokens=sorted(stops), pad_token_id=PAD,
                  return_lengths=True)
    scanned = k3jax.generate(golden_model_fp32, ids, **kwargs)
    np.testing.assert_array_equal(scanned.tokens, expected)
    np.testing.assert_array_equal(scanned.lengths, expected_lengths)

    seen = []
    streamed = k3jax.generate(golden_model_fp32, ids, on_token=seen.append, **kwargs)
    np.testing.assert_array_equal(streamed.tokens, expected)
    np.testing.assert_array_equal(streamed.lengths, expected_lengths)
    np.testing.assert_array_equal(np.stack(seen, axis=1), expected)


def test_streaming_callback_sees_tokens_in_order(golden_model_fp32, padded, batched):
    """Also: a prompt prefilled in chunks of 32 (the 67 pads of row 0 span two chunks) generates the
    tokens of the whole-prompt prefill."""
    ids, lengths = padded
    mask = np.arange(ids.shape[1])[None, :] >= ids.shape[1] - np.asarray(lengths)[:, None]  # same padding as a mask
    seen = []
    out = k3jax.generate(golden_model_fp32, ids, attention_mask=mask, max_new_tokens=NEW, on_token=seen.append,
                         prefill_chunk_size=32)
    assert len(seen) == NEW and all(s.shape == (len(LENGTHS),) and s.dtype == np.int32 for s in seen)
    np.testing.assert_array_equal(np.stack(seen, axis=1), out)
    np.testing.assert_array_equal(out, batched.tokens)


def test_streaming_stops_early_when_every_row_stopped(golden_model_fp32, padded, batched):
    ids, lengths = padded
    first = np.asarray(batched.tokens[:, 0])
    seen = []
    out = k3jax.generate(golden_model_fp32, ids, prompt_lengths=lengths, max_new_tokens=NEW, on_token=seen.append,
                         stop_tokens=first.tolist(), pad_token_id=PAD, return_lengths=True)
    assert len(seen) == 1
    np.testing.assert_array_equal(out.tokens[:, 0], first)
    assert (np.asarray(out.tokens[:, 1:]) == PAD).all()
    np.testing.assert_array_equal(out.lengths, [1] * len(LENGTHS))


def test_sampler_settings_reach_the_loop(golden_model_fp32, padded, batched):
    """top_k=1 or a tiny top_p leave only the argmax, so sampling at temperature 1 is greedy."""
    ids, lengths = padded
    for settings in (dict(top_k=1), dict(top_p=1e-6)):
        out = k3jax.generate(golden_model_fp32, ids, prompt_lengths=lengths, max_new_tokens=NEW, temperature=1.0,
                             seed=3, on_token=lambda _: None, **settings)
        np.testing.assert_array_equal(out, batched.tokens, err_msg=str(settings))


def test_capacity_and_prompt_length_errors(golden_model_fp32, padded):
    ids, lengths = padded
    with pytest.raises(ValueError, match="capacity=74"):
        k3jax.generate(golden_model_fp32, ids, prompt_lengths=lengths, max_new_tokens=NEW, capacity=74)
    with pytest.raises(ValueError, match="prompt_lengths"):
        k3jax.generate(golden_model_fp32, ids, prompt_lengths=[3, 17], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="prompt_lengths"):
        k3jax.generate(golden_model_fp32, ids, prompt_lengths=[0, 17, 70], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="prompt_lengths"):
        k3jax.generate(golden_model_fp32, ids, prompt_lengths=[3, 17, 71], max_new_tokens=NEW)
    right = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
    with pytest.raises(ValueError, match="LEFT padding"):
        k3jax.generate(golden_model_fp32, ids, attention_mask=right, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="not both"):
        k3jax.generate(golden_model_fp32, ids, attention_mask=right, prompt_lengths=lengths, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="top_p"):
        k3jax.generate(golden_model_fp32, ids, max_new_tokens=NEW, temperature=1.0, top_p=0.0)
