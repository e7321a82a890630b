"""The chunked cross-entropy equals the naive one on materialised logits (values and gradients, fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.nn.layers import F32, linear
from k3jax.training import chunked_cross_entropy, naive_cross_entropy


@pytest.mark.parametrize("vocab_chunk", [1000, 96, 37])  # one block, blocks dividing V, a ragged last block
def test_chunked_loss_matches_naive(vocab_chunk):
    rng = np.random.default_rng(0)
    n, d, vocab = 24, 16, 1000
    hidden = jnp.asarray(rng.normal(size=(n, d)), F32)
    head = jnp.asarray(rng.normal(size=(vocab, d)) * 0.5, F32)
    targets = jnp.asarray(rng.integers(0, vocab, n), jnp.int32)
    mask = jnp.asarray(rng.random(n) > 0.3, F32)

    def chunked(h, w):
        s = chunked_cross_entropy(h, w, targets, mask, vocab_chunk=vocab_chunk)
        return s.nll / s.tokens + 1e-2 * s.z / s.tokens, s

    def naive(h, w):
        s = naive_cross_entropy(linear(h, w).astype(F32), targets, mask)
        return s.nll / s.tokens + 1e-2 * s.z / s.tokens, s

    (lc, sc), gc = jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True)(hidden, head)
    (ln, sn), gn = jax.value_and_grad(naive, argnums=(0, 1), has_aux=True)(hidden, head)
    np.testing.assert_allclose(float(lc), float(ln), rtol=1e-6)
    np.testing.assert_allclose(float(sc.nll), float(sn.nll), rtol=1e-6)
    np.testing.assert_allclose(float(sc.z), float(sn.z), rtol=1e-6)
    assert float(sc.tokens) == float(mask.sum())
    for a, b in zip(gc, gn):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_masked_tokens_do_not_count():
    """Targets where the mask is 0 change nothing (even out-of-block ones)."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(6, 8)), F32)
    head = jnp.asarray(rng.normal(size=(50, 8)), F32)
    mask = jnp.asarray([1, 1, 0, 1, 0, 1], F32)
    t1 = jnp.asarray([1, 2, 3, 4, 5, 6], jnp.int32)
    t2 = jnp.asarray([1, 2, 49, 4, 0, 6], jnp.int32)
    a = chunked_cross_entropy(hidden, head, t1, mask, vocab_chunk=16)
    b = chunked_cross_entropy(hidden, head, t2, mask, vocab_chunk=16)
    assert float(a.nll) == float(b.nll) and float(a.tokens) == 4.0
