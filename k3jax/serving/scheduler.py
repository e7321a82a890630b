"""Continuous batching: requests join a running decode batch at step boundaries and leave when done.

One engine thread owns the model and the slot cache (`slots.py`). Each iteration it
  1. takes new submissions and cancellations (a cancelled request frees its slot at once);
  2. makes ONE prefill call to admit from the head of the queue (first come, first served), either
     * a batch: the head requests that are fresh (no prefix-cache hit) and fit one chunk, as many as
       there are free slots and `max_prefill_tokens` allows, prefilled together in one multi-row
       `extend`; each row's first token is sampled and the row copied into its slot; or
     * one chunk of the head request alone (a prefix hit, a prompt wider than one chunk, or a lone
       fresh prompt) on its own one-row cache, continuing the prefix-cache snapshot that matched;
       its first token is sampled and its row inserted once its prompt is done. So a long prompt
       never stalls running requests for its whole length, and a burst is admitted in few calls;
  3. dispatches ONE decode step of every active slot, then reads the step before it and hands each
     request its token (`decode.py`: the host's work overlaps the device's); requests that hit a stop
     token or their token budget are retired (snapshotted into the prefix cache first).
How batches are formed and bounded, and what a batch means for the prefix cache, cancellation,
failures and pod replication: `admission.py`. Compiled shapes are bounded there (bucketed widths,
power-of-two batch rows). Row b of a prefill or decode step computes what the request computes
alone (left padding is exact, see `slots.py`), and step i of a request samples with the i-th key of
its seed (`sampler.py`), so its tokens are those `k3jax.generate` gives for it alone.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from k3jax.generate import extend
from k3jax.model import K3Model, ModelCache
from k3jax.serving.admission import OneRow, bucket, first_tokens, one_row, padded_rows, prefill_batch
from k3jax.serving.decode import FlatModel, InFlight, decode_rows, step_inputs
from k3jax.serving.metrics import Metrics
from k3jax.serving.prefix_cache import PrefixCache, Snapshot
from k3jax.serving.request import (EngineRequest, Finish, GenerationRequest, Handle, QueueFull, ShuttingDown,
                                   Sink)
from k3jax.serving.sampler import request_keys
from k3jax.serving.slots import (IDLE, empty_slots, extract_row, insert_row, insert_rows, row_of, set_clock,
                                 shift_slots)

log = logging.getLogger(__name__)


class Scheduler:
    """The continuous-batching engine. `max_len` bounds prompt + completion of one request."""

    def __init__(self, model: K3Model, *, max_batch: int, max_len: int, prefill_chunk: int = 512,
                 max_queue: int = 1024, prefix_cache: PrefixCache | None = None, metrics: Metrics | None = None,
                 pad_token_id: int | None = None, headroom: int | None = None,
                 max_prefill_tokens: int = 8192) -> None:
        """`headroom`: slot-cache positions beyond max_len; the clock rolls back at most once per that
        many decode steps (default max_len // 4). `pad_token_id` fills padding (default: the config's).
        `max_prefill_tokens`: the most tokens (rows x width, padding included) one batched admission
        prefills; the request at the head of the queue is admitted whatever its width."""
        for name, value, least in (("max_batch", max_batch, 1), ("max_len", max_len, 1), ("max_queue", max_queue, 0),
                                   ("prefill_chunk", prefill_chunk, 1), ("max_prefill_tokens", max_prefill_tokens, 1),
                                   ("headroom", 1 if headroom is None else headroom, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise ValueError(f"{name}={value!r}: expected an integer >= {least}")
        self.model, self.max_batch, self.max_len, self.chunk = model, max_batch, max_len, prefill_chunk
        self._flat_model = FlatModel.of(model)  # the model must not change while the engine runs
        self.max_prefill_tokens, self.max_queue = max_prefill_tokens, max_queue
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
        self.metrics = metrics if metrics is not None else Metrics(max_batch)
        cfg = model.config
        self.pad_id = pad_token_id if pad_token_id is not None else (cfg.pad_token_id or 0)
        self.row_capacity = -(-max_len // prefill_chunk) * prefill_chunk + prefill_chunk
        self.capacity = max_len + (max(max_len // 4, 1) if headroom is None else headroom)
        self._slots = empty_slots(model, max_batch, self.capacity)
        self._length, self._start = 0, [IDLE] * max_batch
        self._active: dict[int, EngineRequest] = {}
        self._free = list(range(max_batch - 1, -1, -1))
        self._pending: collections.deque[EngineRequest] = collections.deque()
        self._prefill: OneRow | None = None
        self._in_flight: InFlight | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = self._abort = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- submission (any thread) -------------------------------------------------------
    def submit(self, req: GenerationRequest, sink: Sink) -> Handle:
        """Queue a request; raises QueueFull or ShuttingDown. The prompt must already be checked."""
        if len(req.prompt) + req.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                             f"max_len={self.max_len}")
        request = EngineRequest(req, sink, time.perf_counter())
        with self._lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are waiting (max {self.max_queue})")
            self._pending.append(request)
        self.metrics.request_started(len(req.prompt))
        self._wake.set()
        return Handle(functools.partial(self._cancel, request))

    def _cancel(self, request: EngineRequest) -> None:
        request.cancelled = True
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="k3jax-engine", daemon=True)
        self._thread.start()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take no more requests; finish the ones in flight (`drain`) or abort them; join the thread."""
        with self._lock:
            self._closed = True
        self._abort = not drain  # the engine thread cancels everything at its next step
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                did = self.step()
            except Exception as err:  # an engine bug fails what is in flight, never the thread
                self._reset(err)
                did = True
            if not did:
                if self._stop.is_set():
                    return
                self._wake.wait(0.05)
                self._wake.clear()

    def _reset(self, err: Exception) -> None:
        """Fail the requests being prefilled and decoded; start again from empty slots."""
        log.error("engine step failed; failing the requests in flight", exc_info=err)
        staged, self._prefill = [self._prefill.request] if self._prefill else [], None
        for request in [*self._active.values(), *staged]:
            self._finish(request, "error", f"{type(err).__name__}: {err}")
        self._active.clear()
        self._in_flight = None
        self._free = list(range(self.max_batch - 1, -1, -1))
        self._length, self._start = 0, [IDLE] * self.max_batch
        self._slots = set_clock(empty_slots(self.model, self.max_batch, self.capacity), self._length, self._start)

    def run_until_idle(self) -> None:
        """Run steps in the calling thread until nothing is queued or running (no engine thread)."""
        while self.step():
            pass

    def step(self) -> bool:
        """One iteration: cancellations, one prefill call (a batch of fresh prompts, or one chunk of one
        prompt), one decode step dispatched and the one before it read. False if there was nothing to do."""
        self._reap_cancelled()
        did = False
        if self._prefill is None and self._free:
            did = self._admit()
        if self._prefill is not None:
            self._run_prefill_chunk()
            did = True
        if self._active or self._in_flight is not None:
            self._decode_step()
            did = True
        self.metrics.observe_state(len(self._pending), len(self._active))
        return did

    # ---- request life cycle ------------------------------------------------------------
    def _finish(self, request: EngineRequest, reason: str, error: str | None = None) -> None:
        if request.finished:
            return
        request.finished = True
        finish = Finish(reason, len(request.req.prompt), len(request.generated), request.cached, error)
        self.metrics.request_finished(reason)
        try:
            request.sink.finish(finish)
        except Exception:  # a broken sink must not stop the engine
            log.exception("request sink failed")

    def _emit(self, request: EngineRequest, token: int) -> str | None:
        """Hand a token to the request; the finish reason if it is its last."""
        if not request.generated:
            self.metrics.first_token(time.perf_counter() - request.submitted)
        request.generated.append(token)
        self.metrics.tokens_generated(1)
        try:
            request.sink.token(token)
        except Exception:
            log.exception("request sink failed")
            return "abort"
        if token in request.req.stop_ids:
            return "stop"
        return "length" if len(request.generated) >= request.req.max_tokens else None

    def _free_slot(self, slot: int) -> None:
        self._start[slot] = IDLE
        self._free.append(slot)

    def _reap_cancelled(self) -> None:
        if self._abort:
            staged = [self._prefill.request] if self._prefill else []
            for request in [*self._pending, *self._active.values(), *staged]:
                request.cancelled = True
        with self._lock:
            dropped = [r for r in self._pending if r.cancelled]
            for r in dropped:
                self._pending.remove(r)
        for r in dropped:
            self._finish(r, "abort")
        if self._prefill is not None and self._prefill.request.cancelled:
            request, self._prefill = self._prefill.request, None
            self._free_slot(request.slot)
            self._finish(request, "abort")
        for slot, request in list(self._active.items()):
            if request.cancelled:
                del self._active[slot]
                self._free_slot(slot)
                self._finish(request, "abort")

    def _next(self) -> EngineRequest | None:
        with self._lock:  # the head of the queue, left there
            return self._pending[0] if self._pending else None

    def _pop(self) -> EngineRequest:
        with self._lock:
            return self._pending.popleft()

    def _admit(self) -> bool:
        """Admit from the head of the queue: a batch of fresh prompts that fit one chunk (run now), or
        the head request alone on the one-row path. False if nothing is queued."""
        batch: list[EngineRequest] = []
        width = 0
        while len(batch) < len(self._free) and (request := self._next()) is not None:
            prompt = request.req.prompt
            snap = self.prefix_cache.lookup(prompt) if self.prefix_cache.enabled else None
            grown = max(width, bucket(len(prompt), self.chunk))
            if snap is not None or grown > self.chunk:
                if not batch:
                    self._begin_prefill(self._pop(), snap)
                break
            if batch and padded_rows(len(batch) + 1) * grown > self.max_prefill_tokens:
                break
            batch.append(self._pop())
            width = grown
        if len(batch) == 1:
            self._begin_prefill(batch[0], None)
        elif batch:
            self._run_batch(batch, width)
        return bool(batch) or self._prefill is not None

    def _take_slot(self, request: EngineRequest) -> None:
        request.slot = self._free.pop()
        request.keys = request_keys(request.req.seed, request.req.max_tokens)

    def _begin_prefill(self, request: EngineRequest, snap: Snapshot | None) -> None:
        self._take_slot(request)
        request.cached = len(snap.tokens) if snap is not None else 0
        self.metrics.prefix_lookup(len(request.req.prompt), request.cached)
        self._prefill = one_row(self.model, request, snap, self.chunk, self.row_capacity, self.pad_id)

    def _run_prefill_chunk(self) -> None:
        prefill = self._prefill
        request = prefill.request
        try:
            piece = prefill.pieces.popleft()
            logits, prefill.cache = extend(self.model, prefill.cache, piece.ids, real_tokens=piece.real_tokens)
            if prefill.pieces:
                if self.prefix_cache.enabled:
                    length = int(prefill.cache.length)  # read once: the store takes it too
                    seen = length - int(prefill.cache.start[0])
                    self.prefix_cache.store(request.req.prompt[:seen], prefill.cache, length)
                return
            self._prefill = None
            token = int(first_tokens(logits, [request])[0])
        except Exception as err:  # a failed prefill fails this request only
            log.exception("prefill failed")
            self._prefill = None
            self._free_slot(request.slot)
            self._finish(request, "error", f"{type(err).__name__}: {err}")
            return
        started = self._started(request, token)  # the first token goes out before the snapshot is taken
        self._snapshot(request.req.prompt, None, lambda: prefill.cache)
        if started:
            self._insert(request, prefill.cache)

    def _run_batch(self, batch: list[EngineRequest], width: int) -> None:
        """Prefill fresh prompts together, hand each its first token, insert the rows still running."""
        for request in batch:
            self._take_slot(request)
            self.metrics.prefix_lookup(len(request.req.prompt), 0)
        try:
            logits, cache = prefill_batch(self.model, [r.req.prompt for r in batch], width, self.pad_id)
            tokens = first_tokens(logits, batch)
            if self.prefix_cache.enabled:
                for r, request in enumerate(batch):
                    self.prefix_cache.store(request.req.prompt, row_of(cache, np.int32(r)))
        except Exception as err:  # a failed batch prefill fails its requests only
            log.exception("batched prefill failed")
            for request in batch:
                self._free_slot(request.slot)
                self._finish(request, "error", f"{type(err).__name__}: {err}")
            return
        kept = [(r, request) for r, request in enumerate(batch) if self._started(request, int(tokens[r]))]
        if not kept:
            return
        self._catch_up(max(len(request.req.prompt) for _, request in kept))
        sources, targets = np.zeros(len(logits), np.int32), np.zeros(len(logits), np.int32)
        for i, (r, request) in enumerate(kept):
            sources[i], targets[i] = r, request.slot
            self._start[request.slot] = self._length - len(request.req.prompt)
            self._active[request.slot] = request
        self._slots = insert_rows(self._slots, cache, sources, targets, np.int32(len(kept)),
                                  np.int32(self._length - width))
        self._slots = set_clock(self._slots, self._length, self._start)

    def _started(self, request: EngineRequest, token: int) -> bool:
        """Hand a prefilled request its first token; False (slot freed, request finished) if it was
        cancelled while it was prefilled, or that token is its last."""
        reason = "abort" if request.cancelled else self._emit(request, token)
        if reason is None:
            return True
        self._free_slot(request.slot)
        self._finish(request, reason)
        return False

    def _catch_up(self, real: int) -> None:
        """Make the clock at least `real` (a prompt about to be inserted holds that many tokens)."""
        if real > self._length:  # the clock is behind this prompt: move every row later
            self._shift(real - self._length)

    def _shift(self, delta: int) -> None:
        """Move the clock and every active row `delta` positions (later if positive)."""
        if self._active:
            self._slots = shift_slots(self._slots, np.int32(delta))
            for slot in self._active:
                self._start[slot] += delta
        self._length += delta

    def _insert(self, request: EngineRequest, row: ModelCache) -> None:
        row_length = int(row.length)
        real = row_length - int(row.start[0])
        self._catch_up(real)
        self._slots = insert_row(self._slots, row, np.int32(request.slot), np.int32(self._length - row_length))
        self._start[request.slot] = self._length - real
        self._slots = set_clock(self._slots, self._length, self._start)
        self._active[request.slot] = request

    def _decode_step(self) -> None:
        """Dispatch the next decode step of the active rows, then read the step dispatched before it."""
        previous, self._in_flight = self._in_flight, None
        if self._active:
            if self._length >= self.capacity:  # out of positions: drop those before the oldest request
                self._shift(-min(self._start[s] for s in self._active))
                self._slots = set_clock(self._slots, self._length, self._start)
            try:
                inputs = step_inputs(self._active, previous, self.max_batch, self.pad_id)
                last = previous.tokens if previous is not None else np.zeros(self.max_batch, np.int32)
                tokens, self._slots = decode_rows(self._flat_model, self._slots, last, inputs,
                                                  any_sampling=bool((inputs.params.temperature > 0).any()))
            except Exception as err:  # the cache was donated: start over with empty slots
                self._reset(err)
                return
            self._length += 1
            self._in_flight = InFlight(tokens, dict(self._active))
        if previous is not None:
            self._read(previous)

    def _read(self, step: InFlight) -> None:
        """Hand out a dispatched step's tokens to the requests still in their slots; retire the ones done."""
        try:
            tokens = np.asarray(step.tokens)
        except Exception as err:  # the step failed on the device
            self._reset(err)
            return
        for slot, request in step.rows.items():
            if self._active.get(slot) is not request:  # retired, cancelled or replaced since
                continue
            reason = self._emit(request, int(tokens[slot]))
            if reason is not None:
                del self._active[slot]
                self._retire(request, reason)

    def _retire(self, request: EngineRequest, reason: str) -> None:
        """Free the slot; first snapshot its prompt and completion into the prefix cache. Retired as its last
        token is read, after the step fed that token was dispatched (every active row is in every step),
        its cache holds the whole completion; its length is the host's (no wait for that step)."""
        start = self._start[request.slot]
        self._snapshot(request.req.prompt + tuple(request.generated), self._length - start,
                       lambda: extract_row(self._slots, np.int32(request.slot), np.int32(start), self.row_capacity))
        self._free_slot(request.slot)
        self._finish(request, reason)

    def _snapshot(self, tokens: tuple[int, ...], length: int | None, take_row: Callable[[], ModelCache]) -> None:
        """Snapshot `take_row()` (clock `length`; None: read it); a failure loses only the snapshot."""
        if self.prefix_cache.enabled:
            try:
                self.prefix_cache.store(tokens, take_row(), length)
            except Exception:
                log.exception("prefix snapshot failed")
