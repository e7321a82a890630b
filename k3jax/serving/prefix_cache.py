"""Prefix cache: snapshots of one-row caches keyed by the exact tokens they hold, reused by any
request whose prompt starts with those tokens (multi-turn chat, shared system prompts).

A snapshot is what the model needs to continue a sequence: per KDA layer the fp32 state and conv
window, per MLA layer the latents of the cached positions, and the row's clock and left padding.
Latents are kept to the cached length rounded up to a multiple of `SNAPSHOT_ALIGN` positions (those
past the clock are never read), so taking and restoring snapshots compiles one program per
multiple, not one per prompt length (a compile on every request's path otherwise). Snapshots are
taken at the end of a prompt's prefill, at prefill chunk boundaries and at a request's end (prompt
plus completion). A lookup returns the longest snapshot whose tokens are a proper prefix of the
prompt (at least one prompt token is left to run, whose logits give the first new token). Entries
are bounded by a byte budget with least-recently-used eviction.

Lookup: each entry is indexed by (length, hash of its tokens); a prompt's prefix hashes are computed
once, then every stored length is probed longest first and a hash hit is confirmed token by token.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.model import ModelCache
from k3jax.nn.mla import MLACache


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    cache: ModelCache  # one row; MLA latents to the cached positions rounded up to SNAPSHOT_ALIGN
    nbytes: int


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """hash(tokens[:n]) for n = 0..len(tokens), each from the previous one (Python ints, mod 2**61 - 1)."""
    modulus, base = (1 << 61) - 1, 1_000_003
    out, h = [0], 0
    for t in tokens:
        h = (h * base + t + 1) % modulus
        out.append(h)
    return out


def _map_latents(fn, cache: ModelCache) -> ModelCache:
    def each(part: tuple, axis: int) -> tuple:
        return tuple(MLACache(fn(c.latent, axis + 1)) if isinstance(c, MLACache) else c for c in part)
    return cache._replace(head=each(cache.head, 0), groups=each(cache.groups, 1), tail=each(cache.tail, 0))


SNAPSHOT_ALIGN = 128  # positions


def trimmed(cache: ModelCache, length: int | None = None) -> ModelCache:
    """A copy of a one-row cache whose MLA latents keep the written positions, `length` (the cache's
    clock; read from the device when not given) rounded up to `SNAPSHOT_ALIGN`. A snapshot owns its
    buffers: the prefill that goes on donates the cache it was taken from."""
    length = int(cache.length) if length is None else length
    return _copy_trimmed(cache, width=-(-max(length, 1) // SNAPSHOT_ALIGN) * SNAPSHOT_ALIGN)


@functools.partial(jax.jit, static_argnames=("width",))
def _copy_trimmed(cache: ModelCache, width: int) -> ModelCache:
    copy = jax.tree.map(jnp.copy, cache)
    return _map_latents(lambda x, axis: jax.lax.slice_in_dim(x, 0, min(width, x.shape[axis]), axis=axis), copy)


@functools.partial(jax.jit, static_argnames=("capacity",))
def restored(cache: ModelCache, capacity: int) -> ModelCache:
    """A snapshot's cache padded back to `capacity` positions (a fresh copy, safe to donate)."""
    def pad(x, axis):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, capacity - x.shape[axis])
        return jnp.pad(x, widths)
    return _map_latents(pad, jax.tree.map(jnp.copy, cache))


class PrefixCache:
    """Snapshots by exact token prefix, bounded by `budget_bytes` (0 disables it); thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, int], Snapshot] = OrderedDict()  # (length, hash) -> snapshot
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> Snapshot | None:
        """The longest snapshot whose tokens are a proper prefix of `prompt` (marked recently used)."""
        if not self._entries:
            return None
        hashes = _prefix_hashes(prompt)
        with self._lock:
            for length in sorted({n for n, _ in self._entries if n < len(prompt)}, reverse=True):
                key = (length, hashes[length])
                entry = self._entries.get(key)
                if entry is not None and entry.tokens == tuple(prompt[:length]):
                    self._entries.move_to_end(key)
                    return entry
        return None

    def contains(self, tokens: Sequence[int]) -> bool:
        key = (len(tokens), _prefix_hashes(tokens)[-1])
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.tokens == tuple(tokens)

    def store(self, tokens: Sequence[int], cache: ModelCache, length: int | None = None) -> bool:
        """Keep a snapshot of the one-row `cache` (which holds exactly `tokens`; `length`: its clock,
        when the caller knows it, saves waiting for the device); False if it alone exceeds the
        budget. Older entries are evicted to make room."""
        if not self.enabled or not tokens or self.contains(tokens):
            return False
        snap = trimmed(cache, length)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(snap))
        if nbytes > self.budget_bytes:
            return False
        key = (len(tokens), _prefix_hashes(tokens)[-1])
        with self._lock:
            old = self._entries.pop(key, None)  # same length and hash, other tokens: the newer one wins
            self.nbytes -= old.nbytes if old is not None else 0
            while self._entries and self.nbytes + nbytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
            self._entries[key] = Snapshot(tuple(tokens), snap, nbytes)
            self.nbytes += nbytes
        return True
