"""Pod replication in one process: the record's bytes, and a follower replaying the leader's records.

The leader runs its engine thread on k3-tiny-a (fp32) with a channel that keeps every payload; the first
two requests reach the engine in one record (admitted in one batched prefill), others arrive while
those decode, one is cancelled by its client and one has a sink that fails (cancelled through the
next record). A follower given the same payloads must make the same decisions: the same batches, the
same tokens and finish reasons per request, the same clock and prefix-cache entries.
"""

from __future__ import annotations

import threading

import pytest

from k3jax.serving import scheduler as scheduler_module
from k3jax.serving.prefix_cache import PrefixCache
from k3jax.serving.replicate import Record, ReplicatedScheduler, decode_record, encode_record
from k3jax.serving.request import Finish, GenerationRequest

ENGINE = dict(max_batch=2, max_len=32, prefill_chunk=16)


def test_records_round_trip_as_json():
    record = Record(new=((7, GenerationRequest((1, 2, 3), 4, 0.8, 50, 0.9, seed=11, stop_ids=frozenset({258, 5}))),
                         (8, GenerationRequest((9,), 1))), cancel=(3, 7), stop=True, abort=False)
    payload = encode_record(record)
    assert payload.startswith(b"{") and decode_record(payload) == record
    assert encode_record(Record()) == b"" and decode_record(b"") == Record()
    assert decode_record(encode_record(Record(abort=True, stop=True))) == Record(abort=True, stop=True)


@pytest.mark.parametrize("payload", [b"\x80\x04pickle", b"[]", b'{"new": [{"id": 1}], "cancel": [], '
                                     b'"stop": false, "abort": false}', b'{"new": []}'])
def test_a_bad_record_is_refused(payload):
    with pytest.raises(ValueError, match="engine record"):
        decode_record(payload)


class Tape:
    """The leader's channel keeps what it sends; the follower's plays it back in order."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def exchange(self, payload: bytes | None) -> bytes:
        if payload is None:
            return self.sent.pop(0)
        self.sent.append(payload)
        return payload


class Collect:
    def __init__(self, fail_after: int | None = None) -> None:
        self.tokens: list[int] = []
        self.result: Finish | None = None
        self.first, self.done = threading.Event(), threading.Event()
        self.fail_after = fail_after

    def token(self, token: int) -> None:
        if self.fail_after is not None and len(self.tokens) >= self.fail_after:
            raise RuntimeError("the client's queue is gone")
        self.tokens.append(token)
        self.first.set()

    def finish(self, finish: Finish) -> None:
        self.result = finish
        self.done.set()


def _outcomes(engine: ReplicatedScheduler) -> dict[int, tuple[str, tuple[int, ...]]]:
    """Record each request's finish reason and tokens as the engine decides them."""
    seen: dict[int, tuple[str, tuple[int, ...]]] = {}
    finish = engine._finish

    def spy(request, reason, error=None):
        seen.setdefault(request.sink.rid, (reason, tuple(request.generated)))
        finish(request, reason, error)

    engine._finish = spy
    return seen


def test_a_follower_replaying_the_records_decides_as_the_leader(golden_model_fp32, monkeypatch):
    batches: list[list[int]] = []  # the prompt lengths of every batched prefill, the leader's then the follower's
    real_batch = scheduler_module.prefill_batch

    def recording(model, prompts, width, pad_id):
        batches.append([len(p) for p in prompts])
        return real_batch(model, prompts, width, pad_id)

    monkeypatch.setattr(scheduler_module, "prefill_batch", recording)
    tape = Tape()
    leader = ReplicatedScheduler(golden_model_fp32, channel=tape, leader=True, idle_wait_s=0.01,
                                 prefix_cache=PrefixCache(1 << 24), **ENGINE)
    follower = ReplicatedScheduler(golden_model_fp32, channel=tape, leader=False,
                                   prefix_cache=PrefixCache(1 << 24), **ENGINE)
    led, followed = _outcomes(leader), _outcomes(follower)
    with pytest.raises(RuntimeError, match="only the leader"):
        follower.submit(GenerationRequest((1,), 1), Collect())
    sinks = [Collect(), Collect(), Collect(fail_after=2), Collect(), Collect()]
    prompts = [(5, 6, 7), (10, 11, 12, 13, 14), (20, 21), (5, 6, 7, 8), (30,) * 9]
    handles = [leader.submit(GenerationRequest(prompts[0], 12), sinks[0]),
               leader.submit(GenerationRequest(prompts[1], 20), sinks[1])]
    leader.start()  # both are in the first record
    assert sinks[1].first.wait(300)
    handles[1].cancel()  # its client went away mid-decode
    handles += [leader.submit(GenerationRequest(p, 6), s) for p, s in zip(prompts[2:], sinks[2:])]
    assert all(s.done.wait(120) for i, s in enumerate(sinks) if i != 2)  # a failed sink hears nothing more
    leader.stop(drain=True, timeout=120)
    assert not leader._thread.is_alive() and leader.failed is None
    led_batches = list(batches)

    follower._loop()  # the records end with the leader's stop, so the loop returns
    assert follower.failed is None and not tape.sent
    assert [led[i][0] for i in range(5)] == ["length", "abort", "abort", "length", "length"]
    assert [len(led[i][1]) for i in (0, 2, 3, 4)] == [12, 3, 6, 6] and 1 <= len(led[1][1]) < 20
    assert [list(led[i][1]) for i in (0, 1, 3, 4)] == [sinks[i].tokens for i in (0, 1, 3, 4)]
    assert sinks[2].tokens == list(led[2][1][:2]) and sinks[2].result is None  # its third token failed
    assert led == followed
    assert led_batches[0] == [3, 5] and batches == led_batches * 2
    assert (follower._length, follower._start) == (leader._length, leader._start)
    assert len(leader.prefix_cache) > 0 and list(follower.prefix_cache._entries) == list(leader.prefix_cache._entries)
    counts = [m.render().split("k3jax_generation_tokens_per_second")[0] for m in (leader.metrics, follower.metrics)]
    assert counts[0] == counts[1]
