"""The continuous-batching engine on k3-tiny-a (fp32), without HTTP.

Reference: `k3jax.generate` run alone on each prompt (batch 1, streamed with a fixed capacity so that
its decode step compiles once). A request's tokens must be identical whatever else shares the batch:
requests outnumber the slots (admitted mid-decode as others retire), short fresh prompts are admitted
together in one batched prefill (a dummy row pads three to four) between two-chunk prompts that take
the one-row path, prompts have different lengths (rows at different offsets of the shared clock), one
request in a batch samples with a seed, and the clock is made to run out of positions (rows rolled
back) and to fall behind a long prompt (rows rolled on).
"""

from __future__ import annotations

import numpy as np
import pytest

import k3jax
from k3jax.serving import admission
from k3jax.serving import scheduler as scheduler_module
from k3jax.serving.prefix_cache import PrefixCache
from k3jax.serving.request import Finish, GenerationRequest
from k3jax.serving.scheduler import Scheduler

MAX_LEN, CHUNK, HEADROOM = 32, 16, 3
REF_CAPACITY = MAX_LEN  # every request fits: prompt + max_tokens <= MAX_LEN
MAX_BATCH = 4
# 5, 13, 9: one batch (the two-chunk 30 stops it); the 30 arrives while the clock is behind it; 13 and 9
# retire together, so 5 and 13 form a second batch
LENGTHS = (5, 13, 9, 30, 21, 5, 13, 11)
BUDGETS = {5: 20, 30: 2, 13: 12, 9: 12, 21: 10, 11: 8}
SAMPLED = 2  # this request samples (temperature, top-k, top-p, seed)
EOS = 258


class Collect:
    """A scheduler sink that keeps what it is given."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.result: Finish | None = None

    def token(self, token: int) -> None:
        self.tokens.append(token)

    def finish(self, finish: Finish) -> None:
        self.result = finish


def _request(prompt: list[int], index: int) -> GenerationRequest:
    if index == SAMPLED:
        return GenerationRequest(tuple(prompt), BUDGETS[len(prompt)], 0.8, 50, 0.9, seed=3, stop_ids=frozenset({EOS}))
    return GenerationRequest(tuple(prompt), BUDGETS[len(prompt)], stop_ids=frozenset({EOS}))


def _alone(model, req: GenerationRequest) -> list[int]:
    out = k3jax.generate(model, np.asarray([req.prompt], np.int32), max_new_tokens=req.max_tokens,
                         temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                         stop_tokens=sorted(req.stop_ids), capacity=REF_CAPACITY, on_token=lambda _: None,
                         return_lengths=True)
    return np.asarray(out.tokens)[0, : int(out.lengths[0])].tolist()


@pytest.fixture(scope="module")
def engine(golden_model_fp32):
    return Scheduler(golden_model_fp32, max_batch=MAX_BATCH, max_len=MAX_LEN, prefill_chunk=CHUNK,
                     headroom=HEADROOM, prefix_cache=PrefixCache(1 << 26))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, n).tolist() for n in LENGTHS]


class Batches:
    """Wraps `prefill_batch` in the scheduler module: records each batch's prompt lengths, and can run
    `before()` first (while the batch is being admitted)."""

    def __init__(self, monkeypatch, before=None) -> None:
        self.lengths: list[list[int]] = []
        self.before = before
        real = scheduler_module.prefill_batch

        def recording(model, prompts, width, pad_id):
            self.lengths.append([len(p) for p in prompts])
            if self.before is not None:
                self.before()
            return real(model, prompts, width, pad_id)

        monkeypatch.setattr(scheduler_module, "prefill_batch", recording)


@pytest.fixture(scope="module")
def served(engine, prompts):
    """Every request submitted at once, run to the end; the clock rolls and the batches recorded."""
    shifts: list[int] = []
    real_shift = scheduler_module.shift_slots

    def counting(slots, shift):
        shifts.append(int(shift))
        return real_shift(slots, shift)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler_module, "shift_slots", counting)
        batches = Batches(patch)
        requests = [_request(p, i) for i, p in enumerate(prompts)]
        sinks = [Collect() for _ in requests]
        for req, sink in zip(requests, sinks):
            engine.submit(req, sink)
        engine.run_until_idle()
    return requests, sinks, shifts, batches.lengths


def test_tokens_equal_generate_alone(golden_model_fp32, served):
    requests, sinks, shifts, batches = served
    assert any(s < 0 for s in shifts) and any(s > 0 for s in shifts), f"the clock never rolled both ways: {shifts}"
    assert batches[0] == [5, 13, 9] and [5, 13] in batches[1:], f"batches admitted: {batches}"
    for i, (req, sink) in enumerate(zip(requests, sinks)):
        assert sink.result.reason in ("stop", "length") and sink.result.completion_tokens == len(sink.tokens)
        assert sink.tokens == _alone(golden_model_fp32, req), f"request {i} (prompt {len(req.prompt)} tokens)"


def test_prefix_hit_is_identical_and_skips_the_prefix(golden_model_fp32, engine, served, monkeypatch):
    """A follow-up turn (a finished request's prompt + completion + new tokens) continues from its
    snapshot: the 4 tokens after it run as one call, right-padded to the smallest bucket."""
    requests, sinks, _, _ = served
    first, out = requests[2], sinks[2].tokens
    follow = GenerationRequest(first.prompt + tuple(out) + (7, 8, 9), 3, stop_ids=frozenset({EOS}))
    ran: list[tuple[int, int | None]] = []
    real_extend = scheduler_module.extend

    def counting(model, cache, ids, real_tokens=None):
        ran.append((ids.shape[1], real_tokens))
        return real_extend(model, cache, ids, real_tokens=real_tokens)

    monkeypatch.setattr(scheduler_module, "extend", counting)
    sink = Collect()
    engine.submit(follow, sink)
    engine.run_until_idle()
    cached = len(first.prompt) + len(out)  # the step after its last token fed that token too
    assert sink.result.cached_tokens == cached
    assert ran == [(admission.MIN_BUCKET, len(follow.prompt) - cached)]
    assert sink.tokens == _alone(golden_model_fp32, follow)
    assert engine.metrics.prefix_hits >= 1


def test_steps_are_read_one_step_late(golden_model_fp32):
    """Each iteration dispatches a decode step before it reads the one before: a request's token k
    reaches its sink in the iteration after the step that sampled it, and the step after its last
    token (its output dropped) leaves that token in the cache, so the prefix snapshot holds them all."""
    engine = Scheduler(golden_model_fp32, max_batch=2, max_len=MAX_LEN, prefill_chunk=CHUNK,
                       prefix_cache=PrefixCache(1 << 26))
    req = GenerationRequest(tuple(range(40, 46)), 3)
    sink = Collect()
    engine.submit(req, sink)
    seen = []
    while engine.step():
        seen.append((len(sink.tokens), engine._in_flight is not None))
    # prefill (token 0) + step 1 dispatched; step 2 dispatched, 1 read; step 3 (its token dropped)
    # dispatched, 2 read: done; step 3 read and dropped
    assert seen == [(1, True), (2, True), (3, True), (3, False)]
    assert sink.result.reason == "length" and sink.tokens == _alone(golden_model_fp32, req)
    snap = engine.prefix_cache.lookup(req.prompt + tuple(sink.tokens) + (1,))
    assert snap is not None and snap.tokens == req.prompt + tuple(sink.tokens)


def test_continuation_pieces():
    """The rest after a prefix hit: whole chunks as they are, the remainder right-padded to its bucket."""
    tokens = np.arange(1, 38, dtype=np.int32)
    pieces = admission.continuation(tokens, CHUNK, pad_id=0)
    assert [(p.ids.shape, p.real) for p in pieces] == [((1, 16), 16), ((1, 16), 16), ((1, 16), 5)]
    np.testing.assert_array_equal(np.concatenate([p.ids[0, : p.real] for p in pieces]), tokens)
    assert not pieces[-1].ids[0, 5:].any()
    assert [(p.ids.shape, p.real) for p in admission.continuation(tokens[:9], 64, 0)] == [((1, 16), 9)]
    assert [p.real for p in admission.continuation(tokens[:32], CHUNK, 0)] == [16, 16]


def test_cancel_frees_the_slot(engine, prompts):
    sink = Collect()
    handle = engine.submit(GenerationRequest(tuple(prompts[0]), 20), sink)
    engine.step()  # prefill: the request holds a slot
    engine.step()
    handle.cancel()
    engine.run_until_idle()
    assert sink.result.reason == "abort" and len(sink.tokens) < 20
    assert sorted(engine._free) == list(range(MAX_BATCH)) and not engine._active


def _fresh(count: int, seed: int) -> list[list[int]]:
    """`count` new prompts with the lengths (and so the budgets) of the first requests of `LENGTHS`."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in LENGTHS[:count]]


def test_a_burst_is_admitted_in_one_step(golden_model_fp32, engine, monkeypatch):
    """Queued short prompts are prefilled in ONE call: after one step every one has its first token
    (its first decode step is dispatched, read in the next step); each still gets the tokens
    `generate` gives it alone."""
    batches = Batches(monkeypatch)
    prompts = _fresh(3, seed=12)
    requests = [_request(p, i) for i, p in enumerate(prompts)]
    sinks = [Collect() for _ in requests]
    for req, sink in zip(requests, sinks):
        engine.submit(req, sink)
    queries = engine.metrics.prefix_queries
    engine.step()
    assert batches.lengths == [[5, 13, 9]] and all(len(s.tokens) == 1 for s in sinks)
    assert engine.metrics.prefix_queries == queries + 3
    engine.run_until_idle()
    for i, (req, sink) in enumerate(zip(requests, sinks)):
        assert sink.tokens == _alone(golden_model_fp32, req), f"request {i} (prompt {len(req.prompt)} tokens)"


def test_a_batch_without_padding_runs_unmasked(golden_model_fp32, engine, monkeypatch):
    """Prompts as wide as their bucket fill every row: the batch prefills with no left-padding starts
    (the unmasked attention `generate` uses on equal prompts), and each request still gets the
    tokens `generate` gives it alone."""
    starts = []
    real_extend = admission.extend

    def recording(model, cache, ids):
        starts.append(cache.start)
        return real_extend(model, cache, ids)

    monkeypatch.setattr(admission, "extend", recording)
    rng = np.random.default_rng(13)
    requests = [GenerationRequest(tuple(rng.integers(0, 256, CHUNK).tolist()), 6) for _ in range(MAX_BATCH)]
    sinks = [Collect() for _ in requests]
    for req, sink in zip(requests, sinks):
        engine.submit(req, sink)
    engine.run_until_idle()
    assert starts == [None]
    for i, (req, sink) in enumerate(zip(requests, sinks)):
        assert sink.tokens == _alone(golden_model_fp32, req), f"request {i}"


def test_cancel_while_the_batch_is_prefilled(golden_model_fp32, engine, monkeypatch):
    """A request cancelled during its batch's prefill gets no token and frees its slot; the others go on."""
    prompts = _fresh(3, seed=13)
    requests = [_request(p, i) for i, p in enumerate(prompts)]
    sinks = [Collect() for _ in requests]
    handles = [engine.submit(req, sink) for req, sink in zip(requests, sinks)]
    batches = Batches(monkeypatch, before=handles[1].cancel)
    engine.step()
    assert batches.lengths == [[5, 13, 9]]
    assert sinks[1].result.reason == "abort" and sinks[1].tokens == []
    assert all(r.req is not requests[1] for r in engine._active.values())
    assert len(engine._active) == 2 and len(engine._free) == MAX_BATCH - 2
    engine.run_until_idle()
    for i in (0, 2):
        assert sinks[i].tokens == _alone(golden_model_fp32, requests[i]), f"request {i}"
    assert sorted(engine._free) == list(range(MAX_BATCH))


def test_a_failed_batch_fails_its_requests_only(golden_model_fp32, engine, monkeypatch):
    """A batched prefill that raises finishes its requests with "error" and frees their slots; the
    request already decoding goes on to the tokens it gets alone."""
    prompts = _fresh(3, seed=14)
    requests = [_request(p, i) for i, p in enumerate(prompts)]
    sinks = [Collect() for _ in requests]
    engine.submit(requests[0], sinks[0])
    engine.step()  # alone: the one-row path
    assert len(engine._active) == 1

    def broken():
        raise RuntimeError("device out of memory")

    Batches(monkeypatch, before=broken)
    for req, sink in zip(requests[1:], sinks[1:]):
        engine.submit(req, sink)
    engine.step()
    for sink in sinks[1:]:
        assert sink.result.reason == "error" and "device out of memory" in sink.result.error and not sink.tokens
    assert len(engine._active) == 1 and len(engine._free) == MAX_BATCH - 1
    engine.run_until_idle()
    assert sinks[0].tokens == _alone(golden_model_fp32, requests[0])
    assert sorted(engine._free) == list(range(MAX_BATCH))


@pytest.mark.parametrize("settings, message", [
    ({"headroom": 0}, "headroom=0: expected an integer >= 1"),
    ({"max_queue": -1}, "max_queue=-1: expected an integer >= 0"),
    ({"max_batch": True}, "max_batch=True: expected an integer >= 1"),
    ({"prefill_chunk": 2.0}, "prefill_chunk=2.0: expected an integer >= 1"),
])
def test_bad_engine_settings_are_named(golden_model_fp32, settings, message):
    with pytest.raises(ValueError) as err:
        Scheduler(golden_model_fp32, **{"max_batch": 2, "max_len": 32, **settings})
    assert str(err.value) == message
