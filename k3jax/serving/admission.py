"""Admission: how queued prompts are prefilled before they join the decode batch (`scheduler.py`).

Widths. A fresh prompt (no prefix-cache hit) is left-padded to a bucket: a power of two from
`MIN_BUCKET` up to the chunk size, else a multiple of the chunk size. The rest of a prompt after a
prefix hit runs in chunk-size pieces, the last one right-padded to its bucket (`extend`'s
`real_tokens`: pads leave no trace in the cache), so any rest costs one call per chunk.

Batches. The requests at the head of the queue that are fresh and whose buckets fit one chunk are
prefilled together (`prefill_batch`), as many as there are free slots and the scheduler's
`max_prefill_tokens` allows: (padded rows) x (width) tokens, padding included (the head request is
always admitted). Every row is left-padded to the widest bucket among them and the row count to a
power of two with rows of pad tokens whose results are dropped, so the compiled shapes are
(power-of-two rows) x (bucket width). The batch stops at the first request that does not fit it (the
queue order is kept); that request (a prefix hit, a multi-chunk prompt) and a lone fresh request take
the one-row path (`one_row`), ONE chunk per engine iteration. The budget trades the time to first
token of queued requests against the pause one batch causes in running requests' decode. A batch's
cache holds only `width` positions per row and is dropped once its rows are in their slots; its
per-row fixed state (KDA) is at most the slot cache's again (no more real rows than free slots).

What a batch means for the rest of the engine:
  * prefix cache: lookups are made while the batch is formed, before any row runs, so requests of
    one batch do not reuse each other's prompts; each row's prompt is stored after the batch, in
    queue order (later requests reuse them);
  * metrics: one prefix lookup (no hit) per row; each request's first token when its row is sampled;
  * cancellation: a request cancelled while its batch runs gets no token: it is finished as "abort"
    and its slot freed, while the other rows go on;
  * failure: a failed batched prefill fails the batch's requests only (the slots are untouched);
  * pods (`replicate.py`): batches are a function of the queue, the free slots and the prefix
    cache, never of wall time, so followers replaying the leader's inputs form the same batches.
Left padding is exact in this model (no positional encoding; padded positions are masked), and each
request's first token is drawn with its own key and settings, so a row computes what its prompt
computes alone.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.generate import extend, padded_width
from k3jax.model import K3Model, ModelCache
from k3jax.serving.prefix_cache import Snapshot, restored
from k3jax.serving.request import EngineRequest
from k3jax.serving.sampler import RowParams, sample_rows
from k3jax.serving.slots import empty_row

MIN_BUCKET = 16  # the smallest padded prompt width
_sample = jax.jit(sample_rows, static_argnames=("any_sampling",))


def bucket(count: int, chunk: int) -> int:
    """The padded width of a fresh prompt of `count` tokens."""
    if count >= chunk:
        return -(-count // chunk) * chunk
    return min(chunk, padded_width(count, MIN_BUCKET))


def continuation(tokens: np.ndarray, chunk: int, pad_id: int) -> list[Piece]:
    """The rest of a prompt after a prefix hit as one-row pieces: full chunks, then the remainder
    right-padded with `pad_id` to its bucket."""
    out = [Piece(tokens[None, lo: lo + chunk], chunk) for lo in range(0, len(tokens) - chunk + 1, chunk)]
    rest = tokens[len(out) * chunk:]
    if len(rest):
        ids = np.full((1, bucket(len(rest), chunk)), pad_id, np.int32)
        ids[0, : len(rest)] = rest
        out.append(Piece(ids, len(rest)))
    return out


def padded_rows(count: int) -> int:
    """The row count a batch of `count` prompts is prefilled with: the next power of two."""
    return 1 << (count - 1).bit_length()


def prefill_batch(model: K3Model, prompts: Sequence[Sequence[int]], width: int, pad_id: int
                  ) -> tuple[jax.Array, ModelCache]:
    """Prefill fresh prompts (each at most `width` tokens) together on a cache of `width` positions.

    Returns (last logits [R, V] fp32, the cache [R]) with R = padded_rows(len(prompts)); row r < len(prompts)
    holds prompt r right-aligned to position `width` (start = width - its length); the other rows are pad
    tokens (start 0) to be discarded.
    """
    rows = padded_rows(len(prompts))
    ids = np.full((rows, width), pad_id, np.int32)
    start = np.zeros(rows, np.int32)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt):] = prompt
        start[r] = width - len(prompt)
    # Without a padded row (every prompt as wide as the batch) the prefill runs unmasked, as `generate`
    # on equal prompts does (on GPU: cuDNN's causal mask rather than an explicit mask array); the
    # cache gets its starts afterwards either way, for the rows' insertion and prefix snapshots.
    padded = bool(start.any())
    cache = model.empty_cache(rows, width)
    logits, cache = extend(model, cache._replace(start=jnp.asarray(start)) if padded else cache, ids)
    return logits, cache._replace(start=jnp.asarray(start))


class Piece(NamedTuple):
    """One `extend` call of a one-row prefill: ids np.int32 [1, T] whose first `real` are the prompt's
    (the rest right padding)."""

    ids: np.ndarray
    real: int

    @property
    def real_tokens(self) -> int | None:
        """`extend`'s real_tokens: None when unpadded, so such pieces share the plain programs."""
        return self.real if self.real < self.ids.shape[1] else None


@dataclass(eq=False)
class OneRow:
    """A request being prefilled alone: its one-row cache and the `Piece`s still to run."""

    request: EngineRequest
    cache: ModelCache
    pieces: collections.deque


def one_row(model: K3Model, request: EngineRequest, snap: Snapshot | None, chunk: int, capacity: int,
            pad_id: int) -> OneRow:
    """A one-row prefill: its cache (`capacity` positions; a copy of the snapshot when one matched) and
    the pieces of the prompt still to run (after a snapshot: the `continuation`; fresh: the
    bucket-padded prompt in pieces of at most the chunk size)."""
    prompt = request.req.prompt
    if snap is not None:
        cache = restored(snap.cache, capacity)
        pieces = continuation(np.asarray(prompt[len(snap.tokens):], np.int32), chunk, pad_id)
    else:
        width = bucket(len(prompt), chunk)
        cache = empty_row(model, capacity, width - len(prompt))
        padded = np.asarray([pad_id] * (width - len(prompt)) + list(prompt), np.int32)
        step = min(width, chunk)
        pieces = [Piece(padded[None, lo: lo + step], step) for lo in range(0, width, step)]
    return OneRow(request, cache, collections.deque(pieces))


def first_tokens(logits: jax.Array, requests: Sequence[EngineRequest]) -> np.ndarray:
    """Each request's first token from its row of `logits` [R >= len(requests), V], drawn with its step-0
    key and its settings (`sampler.py`); rows past the requests are greedy and dropped."""
    rows = logits.shape[0]
    settings = [(r.req.temperature, r.req.top_k, r.req.top_p) for r in requests]
    params = RowParams.of(settings + [(0.0, None, None)] * (rows - len(requests)))
    keys = np.zeros((rows, 2), np.uint32)
    keys[: len(requests)] = [r.keys[0] for r in requests]
    tokens = _sample(logits, keys, params, any_sampling=bool((params.temperature > 0).any()))
    return np.asarray(tokens)[: len(requests)]
