"""k3jax.sampling: exact masks on hand-made logits, and sampled frequencies against the target law.

Distribution checks draw n = 20,000 samples (one key, independent rows) from a small categorical and
compare counts O_i with E_i = n p_i by Pearson's chi-square, sum (O_i - E_i)^2 / E_i, which under the
target law is chi-square with (support - 1) degrees of freedom. The bounds are the 0.9999 quantiles
(df 5: 25.74, df 3: 21.11, df 2: 18.42), so a correct sampler fails with probability 1e-4 per check,
while a wrong law fails surely: e.g. the same draws at temperature 0.7 scored against the
temperature-1 law give ~1,700 (checked below). Seeds are fixed, so runs are
deterministic anyway. Supports are also checked exactly: nothing is ever drawn outside them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.sampling import SamplingParams, sample, sampling_logits, top_k_mask, top_p_mask

N = 20_000
CHI2_9999 = {2: 18.42, 3: 21.11, 5: 25.74}
LOGITS = np.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)


def _counts(logits: np.ndarray, seed: int, **settings) -> np.ndarray:
    batch = jnp.broadcast_to(jnp.asarray(logits), (N, logits.shape[-1]))
    draws = jax.jit(lambda x, k: sample(x, k, **settings))(batch, jax.random.key(seed))
    assert draws.dtype == jnp.int32 and draws.shape == (N,)
    return np.bincount(np.asarray(draws), minlength=logits.shape[-1])


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {counts}"
    expected = N * probs[support]
    return float(np.sum((counts[support] - expected) ** 2 / expected))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def test_top_k_mask_exact():
    logits = jnp.asarray([[0.1, 3.0, -1.0, 2.0, 2.5], [5.0, 4.0, 4.0, 1.0, 0.0]])
    out = np.asarray(top_k_mask(logits, 2))
    ninf = -np.inf
    np.testing.assert_array_equal(out[0], [ninf, 3.0, ninf, ninf, 2.5])
    np.testing.assert_array_equal(out[1], [5.0, 4.0, 4.0, ninf, ninf])  # ties with the k-th are kept
    np.testing.assert_array_equal(top_k_mask(logits, 5), logits)
    np.testing.assert_array_equal(top_k_mask(logits, 9), logits)


def test_top_p_mask_exact():
    probs = np.asarray([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.6, 0.25, 0.0]])
    logits = jnp.log(jnp.asarray(probs))
    ninf = -np.inf
    # p = 0.6: 0.5 alone is < 0.6, so 0.2 joins (0.7 >= 0.6).
    kept = np.isfinite(np.asarray(top_p_mask(logits, 0.6)))
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0, 0], [0, 0, 1, 0, 0]])
    # p = 0.85: row 0 needs 0.5 + 0.2 + 0.15; row 1 needs 0.6 + 0.25.
    kept = np.isfinite(np.asarray(top_p_mask(logits, 0.85)))
    np.testing.assert_array_equal(kept, [[1, 1, 1, 0, 0], [0, 0, 1, 1, 0]])
    # The most probable token is always kept; p = 1 keeps everything finite.
    assert np.isfinite(np.asarray(top_p_mask(logits, 1e-9))).sum(-1).tolist() == [1, 1]
    np.testing.assert_array_equal(top_p_mask(logits, 1.0), logits)
    # Surviving logits are unchanged (not renormalised): softmax does that.
    out = np.asarray(top_p_mask(logits, 0.6))
    np.testing.assert_allclose(out[0, :2], np.log(probs[0, :2]), rtol=1e-6)
    assert out[0, 2] == ninf
    # Ties at the nucleus boundary are kept together.
    tied = np.isfinite(np.asarray(top_p_mask(jnp.log(jnp.asarray([[0.4, 0.3, 0.3]])), 0.5)))
    np.testing.assert_array_equal(tied, [[1, 1, 1]])


def test_greedy_and_validation():
    logits = jnp.asarray([[0.0, 2.0, 1.0], [3.0, -1.0, 3.5]], jnp.bfloat16)
    np.testing.assert_array_equal(sample(logits, jax.random.key(0)), [1, 2])
    np.testing.assert_array_equal(sample(logits, jax.random.key(0), top_k=2, top_p=0.5), [1, 2])
    for bad in (dict(temperature=-1.0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0),
                dict(temperature=1.0, top_p=1.5)):
        with pytest.raises(ValueError):
            sample(logits, jax.random.key(0), **bad)
    assert hash(SamplingParams(0.7, 5, 0.9)) == hash(SamplingParams(0.7, 5, 0.9))


def test_settings_are_checked_before_any_cast_and_stored_as_python_numbers():
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=True),
                dict(temperature=1.0, top_k=2.5), dict(temperature=1.0, top_k=True), dict(temperature=1.0, top_k=-1),
                dict(temperature=1.0, top_p=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad)) if len(bad) == 1 else list(bad)[1]):
            SamplingParams(**bad)
    numpy = SamplingParams(np.float32(0.5), np.int64(5), np.float64(0.25))
    assert numpy == SamplingParams(0.5, 5, 0.25) and hash(numpy) == hash(SamplingParams(0.5, 5, 0.25))
    assert [type(v) for v in (numpy.temperature, numpy.top_k, numpy.top_p)] == [float, int, float]
    assert SamplingParams(0).greedy and SamplingParams(1, None, 1).top_p == 1.0


def test_temperature_distribution():
    counts = _counts(LOGITS, seed=0, temperature=0.7)
    assert _chi2(counts, _softmax(LOGITS / 0.7)) <= CHI2_9999[5]
    # And the same law is not passed for the wrong temperature.
    assert _chi2(counts, _softmax(LOGITS)) > 20 * CHI2_9999[5]


def test_top_k_distribution():
    counts = _counts(LOGITS, seed=1, temperature=1.3, top_k=4)
    target = _softmax(np.where(np.arange(6) < 4, LOGITS / 1.3, -np.inf))
    assert _chi2(counts, target) <= CHI2_9999[3]


def test_top_p_never_samples_outside_the_nucleus():
    # softmax(LOGITS) ~ [0.574, 0.211, 0.128, 0.078, 0.029, 0.004]: p = 0.85 keeps the first three.
    probs = _softmax(LOGITS)
    assert probs[:2].sum() < 0.85 <= probs[:3].sum()
    counts = _counts(LOGITS, seed=2, temperature=1.0, top_p=0.85)
    assert counts[3:].sum() == 0
    assert _chi2(counts, np.where(np.arange(6) < 3, probs, 0) / probs[:3].sum()) <= CHI2_9999[2]


def test_sampling_logits_order_is_temperature_then_top_k_then_top_p():
    # T = 0.5 sharpens to ~[0.84, 0.11, 0.04, ...]; top_k=3 then top_p=0.9 keeps the first two.
    out = np.asarray(sampling_logits(jnp.asarray(LOGITS), temperature=0.5, top_k=3, top_p=0.9))
    np.testing.assert_array_equal(np.isfinite(out), [1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(out[:2], LOGITS[:2] / 0.5)


def test_rows_and_seeds_are_independent():
    batch = jnp.zeros((4, 1000))
    a = np.asarray(sample(batch, jax.random.key(5), temperature=1.0))
    b = np.asarray(sample(batch, jax.random.key(5), temperature=1.0))
    c = np.asarray(sample(batch, jax.random.key(6), temperature=1.0))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(set(a.tolist())) > 1
