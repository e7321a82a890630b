"""Absorbed MLA decode attention as partials over key ranges and their log-sum-exp merge, against an
independent float64 numpy softmax attention over all keys: ranges that see nothing (positions not yet
written, or all left padding) add nothing and make no NaN.

Shapes: H = 3 heads, R = 10 latent rank, P = 4 rope dims, S = 16 cached positions. fp32 vs float64
over <= 16 keys: ~1e-7 relative; 1e-5 is a wide margin that a wrong merge weight or mask breaks.
"""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.mla import Partial, absorbed_attention, absorbed_partial, merge_partials  # noqa: E402

H, R, P, S = 3, 10, 4, 16
SCALE = 0.3
TOL = 1e-5


def numpy_attention(q_latent, q_pe, latents, query_pos, start):
    """float64 softmax over all keys: causal, left pads hidden (but a query sees itself)."""
    q_latent, q_pe, latents = (np.asarray(a, np.float64) for a in (q_latent, q_pe, latents))
    scores = (np.einsum("bthr,bsr->bths", q_latent, latents[..., :R])
              + np.einsum("bthd,bsd->bths", q_pe, latents[..., R:])) * SCALE
    keys = np.arange(latents.shape[1])
    visible = keys[None, None, :] <= query_pos[None, :, None]
    if start is not None:
        visible = visible & ((keys[None, None, :] >= np.asarray(start)[:, None, None])
                             | (keys[None, None, :] == query_pos[None, :, None]))
    scores = np.where(visible[:, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bths,bsr->bthr", probs, latents[..., :R])


def inputs(batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((batch, 1, H, R)), jnp.float32),
            jnp.asarray(rng.standard_normal((batch, 1, H, P)), jnp.float32),
            jnp.asarray(rng.standard_normal((batch, S, R + P)), jnp.float32))


CASES = {  # case -> (query position, start per row or None)
    # position 5 of 16 in 4 ranges of 4: ranges 2 and 3 (positions 6..15 not yet written) see nothing.
    "unwritten ranges": (5, None),
    "last position": (15, None),
    # row 1: positions 0..8 are pads, so range 0 and 1 see nothing and range 2 only 9..11; row 0 all.
    "left padding": (11, [0, 9]),
    # row 1's query is its first real token: it sees only itself (its range alone carries the softmax).
    "first real token": (6, [2, 6]),
}


@pytest.mark.parametrize("num_ranges", [1, 4, 16])
@pytest.mark.parametrize("case", CASES)
def test_merged_ranges_equal_softmax_attention(case, num_ranges):
    position, start = CASES[case]
    start = None if start is None else jnp.asarray(start, jnp.int32)
    q_latent, q_pe, latents = inputs(2)
    query_pos = position + jnp.arange(1)
    got = absorbed_attention(q_latent, q_pe, latents, scale=SCALE, query_pos=query_pos, start=start,
                             num_ranges=num_ranges)
    want = numpy_attention(q_latent, q_pe, latents, np.asarray(query_pos), start)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), want, rtol=TOL, atol=TOL)


def test_a_range_with_nothing_visible_is_neutral():
    q_latent, q_pe, latents = inputs(1)
    part = absorbed_partial(q_latent, q_pe, latents[:, 8:], scale=SCALE, query_pos=jnp.arange(3, 4),
                            key_pos=8 + jnp.arange(S - 8), start=None)
    assert np.all(np.asarray(part.max) == -np.inf)
    assert np.all(np.asarray(part.sum) == 0) and np.all(np.asarray(part.out) == 0)
    # Merged with a range that sees keys, it changes nothing; merged alone, zeros rather than NaN.
    seen = absorbed_partial(q_latent, q_pe, latents[:, :8], scale=SCALE, query_pos=jnp.arange(3, 4),
                            key_pos=jnp.arange(8), start=None)
    stack = lambda *ps: jax.tree.map(lambda *xs: jnp.stack(xs), *ps)  # noqa: E731
    alone = merge_partials(stack(seen))
    np.testing.assert_array_equal(np.asarray(merge_partials(stack(part, seen))), np.asarray(alone))
    np.testing.assert_array_equal(np.asarray(merge_partials(stack(part, part))), np.zeros_like(alone))


def test_merge_is_scale_free_in_the_partials():
    """A partial's (max, sum, out) and (max + d, sum e^-d, out e^-d) are the same statistics: the merge
    must give the same output (it rescales by exp(max - M), not by anything absolute)."""
    q_latent, q_pe, latents = inputs(1, seed=3)
    halves = [absorbed_partial(q_latent, q_pe, latents[:, i * 8:(i + 1) * 8], scale=SCALE,
                               query_pos=jnp.arange(15, 16), key_pos=i * 8 + jnp.arange(8), start=None)
              for i in range(2)]
    shifted = Partial(halves[1].max + 30.0, halves[1].sum * np.exp(-30.0), halves[1].out * np.exp(-30.0))
    stack = lambda *ps: jax.tree.map(lambda *xs: jnp.stack(xs), *ps)  # noqa: E731
    np.testing.assert_allclose(np.asarray(merge_partials(stack(halves[0], shifted))),
                               np.asarray(merge_partials(stack(*halves))), rtol=TOL, atol=TOL)
