"""prefill (whole or in chunks) + decode_step must reproduce one forward pass over the whole
sequence (fp32, 1e-5).

All paths compute the same function in fp32; they differ only in operation order (chunked vs
recurrent KDA, other chunk boundaries, blockwise vs absorbed MLA), so agreement is at fp32 rounding
level (~1e-6).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from tests.conftest import rel_rms


@pytest.mark.parametrize("prompt_len", [3, 70])
def test_prefill_then_decode_equals_full_forward(golden_model_fp32, prompt_len):
    steps = 5
    ids = jnp.asarray(np.random.default_rng(prompt_len).integers(0, 512, (2, prompt_len + steps)), jnp.int32)
    full = np.asarray(golden_model_fp32(ids))

    logits, cache = k3jax.prefill(golden_model_fp32, ids[:, :prompt_len], capacity=prompt_len + steps,
                                  return_all_logits=True)
    assert logits.shape == (2, prompt_len, 512)
    assert rel_rms(logits, full[:, :prompt_len]) <= 1e-5
    for t in range(prompt_len, prompt_len + steps):
        step_logits, cache = k3jax.decode_step(golden_model_fp32, cache, ids[:, t])
        assert rel_rms(step_logits, full[:, t]) <= 1e-5, f"step at position {t}"
    assert int(cache.length) == prompt_len + steps


@pytest.mark.parametrize("cuts", [(3, 40, 70), (64, 65, 75)])
def test_extend_in_pieces_equals_full_forward(golden_model_fp32, cuts):
    """A prompt fed as pieces (chat turns, prefill chunks) continues the cache exactly."""
    ids = jnp.asarray(np.random.default_rng(7).integers(0, 512, (2, cuts[-1])), jnp.int32)
    full = np.asarray(golden_model_fp32(ids))
    logits, cache = k3jax.prefill(golden_model_fp32, ids[:, : cuts[0]], capacity=cuts[-1])
    for lo, hi in zip(cuts, cuts[1:]):
        every, cache = k3jax.extend(golden_model_fp32, cache, ids[:, lo:hi], return_all_logits=True)
        assert every.shape == (2, hi - lo, 512)
        assert rel_rms(every, full[:, lo:hi]) <= 1e-5, f"piece [{lo}, {hi})"
    _, cache = k3jax.prefill(golden_model_fp32, ids[:, : cuts[0]], capacity=cuts[-1])
    last, cache = k3jax.extend(golden_model_fp32, cache, ids[:, cuts[0] :])
    assert last.shape == (2, 512) and rel_rms(last, full[:, -1]) <= 1e-5
    with pytest.raises(ValueError, match="no room"):
        k3jax.extend(golden_model_fp32, cache, ids[:, :1])


def test_chunked_prefill_equals_one_forward(golden_model_fp32):
    """A 70-token prompt in chunks of 32 (two full chunks and a 6-token remainder): every position's
    logits, the last position's (the default return), the cache and the next step match the forward.
    Ids [2, 75] and capacity 75, as in test_prefill_then_decode_equals_full_forward[70], so the forward and
    the decode step reuse its compiled programs (free cache slots after the prompt change nothing checked here)."""
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 512, (2, 75)), jnp.int32)
    full = np.asarray(golden_model_fp32(ids))
    every, _ = k3jax.prefill(golden_model_fp32, ids[:, :70], capacity=75, chunk_size=32, return_all_logits=True)
    assert every.shape == (2, 70, 512) and rel_rms(every, full[:, :70]) <= 1e-5
    last, cache = k3jax.prefill(golden_model_fp32, ids[:, :70], capacity=75, chunk_size=32)
    assert last.shape == (2, 512) and rel_rms(last, full[:, 69]) <= 1e-5
    assert int(cache.length) == 70
    step, _ = k3jax.decode_step(golden_model_fp32, cache, ids[:, 70])
    assert rel_rms(step, full[:, 70]) <= 1e-5


def test_chunked_left_padded_prefill_equals_unchunked(golden_model_fp32):
    """Left padding deeper than a chunk (row 0: 67 pads, so its first two chunks are mostly pads):
    the real positions' logits match the unchunked prefill, and each row matches itself alone."""
    rng = np.random.default_rng(4)
    ids, lengths = k3jax.left_pad([rng.integers(0, 511, 3).tolist(), rng.integers(0, 511, 70).tolist()], 511)
    whole, _ = k3jax.prefill(golden_model_fp32, ids, prompt_lengths=lengths, return_all_logits=True)
    chunked, cache = k3jax.prefill(golden_model_fp32, ids, prompt_lengths=lengths, chunk_size=32,
                                   return_all_logits=True)
    np.testing.assert_array_equal(cache.start, [67, 0])
    assert rel_rms(chunked[0, 67:], whole[0, 67:]) <= 1e-5 and rel_rms(chunked[1], whole[1]) <= 1e-5
    alone = np.asarray(golden_model_fp32(ids[:1, 67:]))
    assert rel_rms(chunked[0, 67:], alone[0]) <= 1e-5


def test_decode_past_capacity_is_an_error(golden_model_fp32):
    """Steps fill the cache to its last slot, then one more is an error. Shapes as in
    test_prefill_then_decode_equals_full_forward[3] (batch 2, 3-token prompt, capacity 8), whose compiled
    prefill and decode step this reuses."""
    _, cache = k3jax.prefill(golden_model_fp32, jnp.ones((2, 3), jnp.int32), capacity=8, return_all_logits=True)
    for _ in range(5):
        _, cache = k3jax.decode_step(golden_model_fp32, cache, jnp.ones((2,), jnp.int32))
    assert int(cache.length) == 8
    with pytest.raises(ValueError, match="cache is full"):
        k3jax.decode_step(golden_model_fp32, cache, jnp.ones((2,), jnp.int32))


def test_prefill_rejects_small_capacity_and_bad_ids(golden_model_fp32):
    with pytest.raises(ValueError, match="capacity"):
        k3jax.prefill(golden_model_fp32, jnp.ones((1, 4), jnp.int32), capacity=3)
    with pytest.raises(ValueError, match="input_ids"):
        golden_model_fp32(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="input_ids"):
        golden_model_fp32(jnp.ones((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="vocab_size=512"):
        golden_model_fp32(jnp.asarray([[1, 512]], jnp.int32))


def test_sampling_is_seeded(golden_model_fp32):
    """A [1, 9] prompt and 4 new tokens: the shapes of test_batched_generation_matches_single's single rows,
    so the prefill compiles once for both."""
    prompt = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8, 9]], jnp.int32)
    a = k3jax.generate(golden_model_fp32, prompt, max_new_tokens=4, temperature=1.0, seed=1)
    b = k3jax.generate(golden_model_fp32, prompt, max_new_tokens=4, temperature=1.0, seed=1)
    c = k3jax.generate(golden_model_fp32, prompt, max_new_tokens=4, temperature=1.0, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match="max_new_tokens"):
        k3jax.generate(golden_model_fp32, prompt, max_new_tokens=0)


def test_batched_generation_matches_single(golden_model_fp32):
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)
    both = np.asarray(k3jax.generate(golden_model_fp32, prompts, max_new_tokens=4))
    for b in range(2):
        alone = np.asarray(k3jax.generate(golden_model_fp32, prompts[b : b + 1], max_new_tokens=4))
        np.testing.assert_array_equal(both[b], alone[0])


def test_right_padded_extend_continues_as_unpadded(golden_model_fp32):
    """Continuations right-padded to a bucket (`real_tokens`): 5 real of 16, then 14 real of 16 (one
    compiled program), with random pad ids. The last real position's logits, the cache length and the
    decode steps after them match the forward over the real tokens alone (pads left no trace in the
    KDA state, conv window or MLA cache). Row 0 is left-padded too (start 7), as a served row is.
    Tolerance 2e-5: sixteen recurrent decode steps after two short chunks drift slightly past the
    1e-5 above from the forward's operation order, the same with unpadded pieces; a pad leaking into
    the state or conv window moves the logits by orders of magnitude more."""
    rng = np.random.default_rng(11)
    real = rng.integers(0, 511, (2, 75))
    ids, lengths = k3jax.left_pad([real[0, 7:40].tolist(), real[1, :40].tolist()], 511)
    _, cache = k3jax.prefill(golden_model_fp32, ids, prompt_lengths=lengths, capacity=75)
    full_0 = np.asarray(golden_model_fp32(jnp.asarray(real[:1, 7:], jnp.int32)))
    full_1 = np.asarray(golden_model_fp32(jnp.asarray(real[1:], jnp.int32)))
    for lo, hi, width in ((40, 45, 16), (45, 59, 16)):
        piece = rng.integers(0, 511, (2, width))
        piece[:, : hi - lo] = real[:, lo:hi]
        last, cache = k3jax.extend(golden_model_fp32, cache, piece, real_tokens=hi - lo)
        assert int(cache.length) == hi
        assert rel_rms(last[0], full_0[0, hi - 8]) <= 1e-5 and rel_rms(last[1], full_1[0, hi - 1]) <= 1e-5
    for t in range(59, 75):
        step, cache = k3jax.decode_step(golden_model_fp32, cache, jnp.asarray(real[:, t], jnp.int32))
        assert rel_rms(step[0], full_0[0, t - 7]) <= 2e-5 and rel_rms(step[1], full_1[0, t]) <= 2e-5, f"step {t}"
    for bad in (0, 2, True, 1.0):
        with pytest.raises(ValueError, match="real_tokens"):
            k3jax.extend(golden_model_fp32, cache, jnp.ones((2, 1), jnp.int32), real_tokens=bad)
