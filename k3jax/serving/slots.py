"""Slot-based batch cache: a fixed [max_batch] `ModelCache` where each row (slot) is one request.

Design: every slot shares the cache's one clock (`ModelCache.length`, the position the next decode
step writes), and each slot's sequence is RIGHT-ALIGNED to that clock. A request whose n real tokens
are cached occupies positions [length - n, length) of its row and `start[slot] = length - n`; the
positions before its start are left padding, which the model already masks (MLA hides the keys,
KDA takes identity steps). K3 has no positional encoding, so a row computes exactly what the
request computes alone, whatever its offset, and the model needs no per-row position.

  * insert: a request is prefilled on its own one-row cache (`extend`), or as one row of a batched
    prefill of fresh prompts, then copied into a slot with its MLA latents rolled along the sequence
    axis so that its last token sits at `length - 1`; its KDA state and conv window are
    position-free and are copied as they are.
  * idle slots: `start = IDLE` (past any position), so the row attends only to itself and its KDA
    steps are identities: a free row costs compute but never produces NaN or touches other rows.
  * the clock: decode steps advance `length` for every row. When it reaches the capacity, the rows
    are rolled left by the smallest active start (`shift`), which frees the positions before the
    oldest request; when an inserted prompt is longer than the clock, every row is rolled right.
    Positions at or past `length` are never read before a decode step writes them, so whatever a
    roll wraps around there is harmless.

The slot capacity is `max_len` plus headroom, so a roll to compact happens at most once per
`headroom` decode steps (a row never holds more than max_len - 1 tokens). Start positions are kept
by the scheduler (host) and written here whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3jax.model import K3Model, ModelCache
from k3jax.nn.mla import MLACache

IDLE = 2**30  # start of a free slot: later than any position, so the whole row is padding


def _map_layers(fn: Callable, cache: ModelCache, *others: ModelCache) -> tuple[tuple, tuple, tuple]:
    """Apply fn(layer_cache, *other_layer_caches, batch_axis) to every layer cache; the group caches
    are stacked [G, B, ...], so their batch axis is 1."""
    def each(part: str, axis: int) -> tuple:
        return tuple(fn(c, *(getattr(o, part)[i] for o in others), axis) for i, c in enumerate(getattr(cache, part)))
    return each("head", 0), each("groups", 1), each("tail", 0)


def _roll_latents(cache: ModelCache, shift: jax.Array) -> ModelCache:
    """Roll every MLA latent along its sequence axis by `shift` (positive: later positions)."""
    def roll(c, axis):
        return MLACache(jnp.roll(c.latent, shift, axis=axis + 1)) if isinstance(c, MLACache) else c
    head, groups, tail = _map_layers(roll, cache)
    return cache._replace(head=head, groups=groups, tail=tail)


def empty_slots(model: K3Model, batch: int, capacity: int) -> ModelCache:
    """A slot cache of `batch` idle rows with room for `capacity` positions."""
    cache = model.empty_cache(batch, capacity)
    return cache._replace(start=jnp.full((batch,), IDLE, jnp.int32))


def empty_row(model: K3Model, capacity: int, pad: int = 0) -> ModelCache:
    """A one-row cache for a prefill whose first `pad` positions are left padding."""
    return model.empty_cache(1, capacity)._replace(start=jnp.full((1,), pad, jnp.int32))


def _put_row(slots: ModelCache, row: ModelCache, slot: jax.Array, shift: jax.Array) -> ModelCache:
    def put(dst, src, axis):
        if isinstance(dst, MLACache):
            source = jnp.arange(dst.latent.shape[axis + 1]) - shift
            latent = jnp.take(src.latent, jnp.clip(source, 0, src.latent.shape[axis + 1] - 1), axis=axis + 1)
            return MLACache(_set_row(dst.latent, latent, slot, axis))
        return type(dst)(*(_set_row(d, s, slot, axis) for d, s in zip(dst, src)))

    head, groups, tail = _map_layers(put, slots, row)
    return slots._replace(head=head, groups=groups, tail=tail)


@functools.partial(jax.jit, donate_argnames=("slots",))
def insert_row(slots: ModelCache, row: ModelCache, slot: jax.Array, shift: jax.Array) -> ModelCache:
    """Copy the one-row cache `row` into `slots` at row `slot`, its latents moved `shift` positions
    later (shift = slots.length - row.length, so its last token lands at slots.length - 1). Slot
    positions outside the row's window get copies of its edge latents, which are masked or
    overwritten before they are read. `start` is not touched: the caller sets it (row.start + shift)."""
    return _put_row(slots, row, slot, shift)


@functools.partial(jax.jit, donate_argnames=("slots",))
def insert_rows(slots: ModelCache, rows: ModelCache, sources: jax.Array, targets: jax.Array, count: jax.Array,
                shift: jax.Array) -> ModelCache:
    """For i < count: row sources[i] of the batch cache `rows` into slot targets[i], moved `shift`
    positions later, as `insert_row` (every row of a batched prefill has the same length, so one shift).
    `count` is traced, so one program serves any number of the batch's rows."""
    def body(i, slots):
        return _put_row(slots, _row(rows, sources[i]), targets[i], shift)
    return jax.lax.fori_loop(0, count, body, slots)


def _row(cache: ModelCache, index: jax.Array) -> ModelCache:
    """Row `index` of a batch cache as a one-row cache (the same length)."""
    def take(c, axis):
        return type(c)(*(jax.lax.dynamic_index_in_dim(x, index, axis, keepdims=True) for x in c))
    head, groups, tail = _map_layers(take, cache)
    start = jax.lax.dynamic_index_in_dim(cache.start, index, 0, keepdims=True)
    return ModelCache(head, groups, tail, cache.length, start)


@jax.jit
def row_of(cache: ModelCache, index: jax.Array) -> ModelCache:
    """Row `index` of a batch cache as a one-row cache of its own buffers (a prefix-cache snapshot's source)."""
    return _row(cache, index)


def _set_row(dst: jax.Array, src: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """dst with index `slot` of its batch axis replaced by src's only row (src has batch 1 there)."""
    return jax.lax.dynamic_update_index_in_dim(dst, jax.lax.index_in_dim(src, 0, axis, keepdims=False), slot, axis)


@functools.partial(jax.jit, static_argnames=("capacity",))
def extract_row(slots: ModelCache, slot: jax.Array, start: jax.Array, capacity: int) -> ModelCache:
    """Row `slot` as a one-row cache of `capacity` positions, its real tokens [start, length) moved
    to [0, length - start) (no padding): the form a prefix-cache snapshot keeps."""
    def take(c, axis):
        rows = [jax.lax.dynamic_index_in_dim(x, slot, axis, keepdims=True) for x in c]
        if isinstance(c, MLACache):
            source = jnp.clip(jnp.arange(capacity) + start, 0, rows[0].shape[axis + 1] - 1)
            return MLACache(jnp.take(rows[0], source, axis=axis + 1))
        return type(c)(*rows)

    head, groups, tail = _map_layers(take, slots)
    return ModelCache(head, groups, tail, slots.length - start, jnp.zeros((1,), jnp.int32))


@functools.partial(jax.jit, donate_argnames=("slots",))
def shift_slots(slots: ModelCache, shift: jax.Array) -> ModelCache:
    """Move every row's sequence by `shift` positions (the clock moves with it). `start` is the
    caller's to update."""
    return _roll_latents(slots, shift)._replace(length=slots.length + shift)


def set_clock(slots: ModelCache, length: int, start: list[int]) -> ModelCache:
    """`slots` with the clock and every row's start replaced (host values)."""
    return slots._replace(length=jnp.asarray(length, jnp.int32), start=jnp.asarray(start, jnp.int32))
