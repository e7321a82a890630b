"""Prefix-cache snapshots on k3-tiny-a's cache layout: what a snapshot keeps, and that its shape depends
on the cached length only through multiples of SNAPSHOT_ALIGN (one snapshot program per multiple, not
one per prompt length). Values are random: a snapshot is a copy, so they must come back bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.nn.mla import MLACache
from k3jax.serving.prefix_cache import SNAPSHOT_ALIGN, PrefixCache, restored, trimmed

CAPACITY = 3 * SNAPSHOT_ALIGN


@pytest.fixture(scope="module")
def model(golden_dir):
    return k3jax.from_pretrained(golden_dir, dtype="float32")


def _random_row(model, length: int):
    """A one-row cache of CAPACITY positions, random contents, clock at `length`."""
    cache = model.empty_cache(1, CAPACITY)
    leaves, treedef = jax.tree.flatten(cache._replace(length=None, start=None))
    rng = np.random.default_rng(length)
    leaves = [jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, leaves)._replace(length=jnp.int32(length), start=cache.start)


def _latents(cache) -> list[jax.Array]:
    """Every MLA latent, its positions on axis 1 (stacked groups: layer axis first, moved to the end)."""
    out = []
    for part, axis in ((cache.head, 0), (cache.groups, 1), (cache.tail, 0)):
        out += [jnp.moveaxis(c.latent, 0, -1) if axis else c.latent for c in part if isinstance(c, MLACache)]
    return out


def _without_latents(cache):
    def keep(part: tuple) -> tuple:
        return tuple(c for c in part if not isinstance(c, MLACache))
    return cache._replace(head=keep(cache.head), groups=keep(cache.groups), tail=keep(cache.tail))


@pytest.mark.parametrize("length", [1, 20, SNAPSHOT_ALIGN, SNAPSHOT_ALIGN + 1, CAPACITY])
def test_snapshot_keeps_the_written_positions_rounded_up(model, length):
    row = _random_row(model, length)
    snap = trimmed(row)
    width = min(-(-length // SNAPSHOT_ALIGN) * SNAPSHOT_ALIGN, CAPACITY)
    assert _latents(snap) and all(x.shape[1] == width for x in _latents(snap))
    for kept, full in zip(_latents(snap), _latents(row)):
        np.testing.assert_array_equal(kept, full[:, :width])
    back = restored(snap, CAPACITY)
    assert jax.tree.map(jnp.shape, back) == jax.tree.map(jnp.shape, row)
    for again, full in zip(_latents(back), _latents(row)):
        np.testing.assert_array_equal(again[:, :length], full[:, :length])
    for again, full in zip(jax.tree.leaves(_without_latents(back)), jax.tree.leaves(_without_latents(row))):
        np.testing.assert_array_equal(again, full)  # KDA states and conv windows, clock and start: whole


def test_lengths_within_one_multiple_share_a_shape_and_a_host_length_is_used(model):
    shapes = {length: jax.tree.map(jnp.shape, trimmed(_random_row(model, length))) for length in (3, 57, 128)}
    assert len({str(s) for s in shapes.values()}) == 1
    # the caller's length wins over the device clock (the engine passes its own, saving a wait)
    row = _random_row(model, 5)
    assert all(x.shape[1] == 2 * SNAPSHOT_ALIGN for x in _latents(trimmed(row, SNAPSHOT_ALIGN + 5)))
    cache = PrefixCache(1 << 30)
    assert cache.store(tuple(range(SNAPSHOT_ALIGN + 5)), row, SNAPSHOT_ALIGN + 5)
    snap = cache.lookup(tuple(range(SNAPSHOT_ALIGN + 6)))
    assert snap is not None and snap.nbytes == sum(x.nbytes for x in jax.tree.leaves(snap.cache))
