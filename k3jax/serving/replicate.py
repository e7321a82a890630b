"""Pods: one engine per process, in lockstep, so the model's sharded programs run on every host.

The engine's decisions are a function of the inputs it is given, in order: new requests (prompt ids
and sampling settings), cancellations and shutdown. Nothing else steers it: admission is first come,
first served; prefix-cache lookups and least-recently-used eviction follow the same requests in the
same order; the clock is a step count, not wall time (wall time feeds only the metrics). So every
process runs the same engine loop, and at each iteration boundary the leader (process 0, the one that
serves HTTP) sends that iteration's inputs to every process as a `Record`: JSON bytes, broadcast with
`jax.experimental.multihost_utils.broadcast_one_to_all` (a length, then the bytes padded to a power of
two so the broadcast compiles for few shapes). Every process applies the record, then runs one step.

The leader's request sinks never fail the engine (a failing sink is logged and its request cancelled
through the next record); followers' sinks discard what they are given. An idle leader waits for a
submission (at most `idle_wait_s`) and then broadcasts even an empty record, so followers are never
left inside a collective for long. `stop()` on the leader is sent as the record's `stop` flag
(`abort` when not draining): every process drains or aborts what is in flight, then its loop ends.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from k3jax.model import K3Model
from k3jax.serving.request import EngineRequest, Finish, GenerationRequest, Handle, QueueFull, ShuttingDown, Sink
from k3jax.serving.scheduler import Scheduler

log = logging.getLogger(__name__)
MIN_WIDTH = 256  # the smallest padded broadcast, in bytes


@dataclass(frozen=True)
class Record:
    """One iteration's inputs: new requests (with the ids cancellations name), cancelled ids, shutdown."""

    new: tuple[tuple[int, GenerationRequest], ...] = ()
    cancel: tuple[int, ...] = ()
    stop: bool = False
    abort: bool = False

    def empty(self) -> bool:
        return not (self.new or self.cancel or self.stop or self.abort)


def encode_record(record: Record) -> bytes:
    """JSON bytes (b"" for an empty record: a decode step then costs one small broadcast)."""
    if record.empty():
        return b""
    new = [{"id": rid, "prompt": list(r.prompt), "max_tokens": r.max_tokens, "temperature": r.temperature,
            "top_k": r.top_k, "top_p": r.top_p, "seed": r.seed, "stop_ids": sorted(r.stop_ids)}
           for rid, r in record.new]
    body = {"new": new, "cancel": list(record.cancel), "stop": record.stop, "abort": record.abort}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_record(payload: bytes) -> Record:
    """The record `encode_record` wrote; ValueError naming the field for anything else."""
    if not payload:
        return Record()
    try:
        body = json.loads(payload)
        new = tuple((int(n["id"]), GenerationRequest(
            tuple(int(t) for t in n["prompt"]), int(n["max_tokens"]), float(n["temperature"]),
            None if n["top_k"] is None else int(n["top_k"]), None if n["top_p"] is None else float(n["top_p"]),
            int(n["seed"]), frozenset(int(t) for t in n["stop_ids"]))) for n in body["new"])
        return Record(new, tuple(int(i) for i in body["cancel"]), bool(body["stop"]), bool(body["abort"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"engine record ({len(payload)} bytes): expected the JSON of encode_record: "
                         f"{type(err).__name__}: {err}") from err


class Channel(Protocol):
    """Carries the leader's bytes to every process: the leader passes them, followers pass None."""

    def exchange(self, payload: bytes | None) -> bytes: ...


class BroadcastChannel:
    """`multihost_utils.broadcast_one_to_all` from process 0: the length, then the padded bytes."""

    def exchange(self, payload: bytes | None) -> bytes:
        leader = jax.process_index() == 0
        data = payload if leader and payload else b""
        size = int(multihost_utils.broadcast_one_to_all(np.asarray([len(data)], np.int32))[0])
        if size == 0:
            return b""
        buffer = np.zeros(max(MIN_WIDTH, 1 << math.ceil(math.log2(size))), np.uint8)
        if leader:
            buffer[:size] = np.frombuffer(data, np.uint8)
        return multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes()


class _Relay:
    """Every request's sink: the id cancellations name, and (on the leader) the client's sink, whose
    failures are logged and turned into a cancellation rather than steering this process's engine."""

    def __init__(self, scheduler: "ReplicatedScheduler", rid: int, sink: Sink | None) -> None:
        self.scheduler, self.rid, self.sink = scheduler, rid, sink

    def token(self, token: int) -> None:
        self._call(self.sink.token if self.sink is not None else None, token)

    def finish(self, finish: Finish) -> None:
        self._call(self.sink.finish if self.sink is not None else None, finish)

    def _call(self, method, value) -> None:
        if method is None:
            return
        try:
            method(value)
        except Exception:
            log.exception("request sink failed; cancelling the request")
            self.sink = None
            self.scheduler._cancel_id(self.rid)


class ReplicatedScheduler(Scheduler):
    """The engine of one process of a pod. Only the leader takes `submit` and `stop`; every process
    runs `start()` and the loop ends on the leader's stop (`join()` waits for it)."""

    def __init__(self, model: K3Model, *, channel: Channel, leader: bool, idle_wait_s: float = 1.0,
                 **engine) -> None:
        super().__init__(model, **engine)
        self.channel, self.leader, self.idle_wait_s = channel, leader, idle_wait_s
        self.failed: Exception | None = None  # why the loop ended, if not by the leader's stop
        self._ids = itertools.count()
        self._inbox: list[tuple[int, GenerationRequest, Sink]] = []  # leader: accepted, not yet sent
        self._cancels: list[int] = []  # leader: cancelled ids, not yet sent
        self._stopping: tuple[bool, bool] | None = None  # leader: (stop, abort), not yet sent
        self._live: dict[int, EngineRequest] = {}  # every process: requests by id, until they finish

    # ---- the leader's side (any thread) --------------------------------------------------
    def submit(self, req: GenerationRequest, sink: Sink) -> Handle:
        if not self.leader:
            raise RuntimeError("only the leader (process 0) takes requests")
        if len(req.prompt) + req.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                             f"max_len={self.max_len}")
        with self._lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            waiting = len(self._pending) + len(self._inbox)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting (max {self.max_queue})")
            rid = next(self._ids)
            self._inbox.append((rid, req, sink))
        self._wake.set()
        return Handle(functools.partial(self._cancel_id, rid))

    def _cancel_id(self, rid: int) -> None:
        with self._lock:
            self._cancels.append(rid)
        self._wake.set()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Leader: take no more requests and send the stop (drain or abort) to every process; join."""
        if not self.leader:
            raise RuntimeError("followers stop when the leader's stop reaches them")
        with self._lock:
            self._closed = True
            self._stopping = (True, not drain)
        self._wake.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- every process (the engine thread) -----------------------------------------------
    def _next_record(self, idle: bool) -> tuple[Record, dict[int, Sink]]:
        """Leader: this iteration's inputs, sent; follower: the leader's, received."""
        if not self.leader:
            return decode_record(self.channel.exchange(None)), {}
        if idle:  # nothing ran last step: wait for work (bounded, so followers hear from us)
            self._wake.wait(self.idle_wait_s)
        self._wake.clear()
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            stop, abort = self._stopping or (False, False)
            self._stopping = None
        record = Record(tuple((rid, req) for rid, req, _ in inbox), tuple(cancels), stop, abort)
        self.channel.exchange(encode_record(record))
        return record, {rid: sink for rid, _, sink in inbox}

    def apply(self, record: Record, sinks: dict[int, Sink] | None = None) -> None:
        """Take a record's inputs (the same on every process, in the same place of the loop)."""
        for rid, req in record.new:
            request = EngineRequest(req, _Relay(self, rid, (sinks or {}).get(rid)), time.perf_counter())
            with self._lock:
                self._pending.append(request)
            self._live[rid] = request
            self.metrics.request_started(len(req.prompt))
        for rid in record.cancel:
            if rid in self._live:
                self._live[rid].cancelled = True
        if record.stop:
            with self._lock:
                self._closed = True
            self._stop.set()
        self._abort = self._abort or record.abort

    def _finish(self, request: EngineRequest, reason: str, error: str | None = None) -> None:
        super()._finish(request, reason, error)
        self._live.pop(request.sink.rid, None)

    def _loop(self) -> None:
        did = True
        while True:
            try:
                record, sinks = self._next_record(idle=not did)
                self.apply(record, sinks)
            except Exception as err:  # the pod is broken (a peer gone, a bad record): fail what is in flight
                log.error("engine replication failed; stopping this process's engine", exc_info=err,
                          extra={"all_processes": True})
                self.failed = err
                self._fail_all(err)
                return
            try:
                did = self.step()
            except Exception as err:
                self._reset(err)
                did = True
            if self._stop.is_set() and not did:
                return

    def _fail_all(self, err: Exception) -> None:
        """Fail every request this process knows of, without touching the devices (a peer may be gone)."""
        message = f"{type(err).__name__}: {err}"
        with self._lock:
            self._closed = True
            inbox, self._inbox = self._inbox, []
            self._pending.clear()
        staged = [self._prefill.request] if self._prefill else []
        self._prefill = None
        self._active.clear()
        for request in [*self._live.values(), *staged]:
            self._finish(request, "error", message)
        for _, req, sink in inbox:
            try:
                sink.finish(Finish("error", len(req.prompt), 0, 0, message))
            except Exception:
                log.exception("request sink failed")
