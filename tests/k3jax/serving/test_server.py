"""`k3jax serve` live on k3-tiny-a (fp32), driven by the official `openai` client and raw HTTP.

One server for the module (uvicorn in a thread, 8 slots); the tests run in file order and the last one
shuts it down. Prompts are at most 16 tokens, so every fresh prefill has one compiled width (the
concurrent clients are admitted in batched prefills of a few power-of-two row counts).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from k3jax.chat import k3_tokenizer, parse_reply
from k3jax.tokenizer import load_tokenizer
from tests.conftest import GOLDEN_DIR
from tests.k3jax.serving.live import LiveServer

CLIENTS = 64
NEW = 6


@pytest.fixture(scope="module")
def server():
    live = LiveServer(GOLDEN_DIR).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 17, CLIENTS)]


def _wait(condition, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_health_models_metrics(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("requests_total", "generation_tokens_total", "generation_tokens_per_second", "queue_depth",
                 "batch_occupancy", "time_to_first_token_seconds_count", "prefix_cache_hit_rate"):
        assert re.search(rf"^k3jax_{name}[ {{]", text, re.M), name


def _sequential(client, prompt):
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW,
                                     extra_body={"return_token_ids": True})
    return done.choices[0].token_ids, done.choices[0].finish_reason, done.usage


def _streamed(client, prompt, count=NEW, **extra):
    ids, reasons = [], []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=count, stream=True,
                                           extra_body={"return_token_ids": True, **extra}):
        ids += chunk.choices[0].token_ids
        reasons.append(chunk.choices[0].finish_reason)
    return ids, reasons


def test_concurrent_streams_equal_sequential(server, client, prompts):
    """64 streaming clients at once through 8 slots: each gets the tokens it gets alone."""
    alone = [_sequential(client, p) for p in prompts]
    for (ids, reason, used), p in zip(alone, prompts):
        assert used.prompt_tokens == len(p) and used.completion_tokens == len(ids) <= NEW
        assert reason == ("length" if len(ids) == NEW else "stop")
    with ThreadPoolExecutor(CLIENTS) as pool:
        together = list(pool.map(lambda p: _streamed(client, p), prompts))
    for k, ((ids, reasons), (want, reason, _)) in enumerate(zip(together, alone)):
        assert ids == want, f"client {k}"
        assert reasons[-1] == reason and all(r is None for r in reasons[:-1])
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f"k3jax_requests_total {2 * CLIENTS}" in metrics


def test_stop_token_ends_the_completion(client, prompts):
    ids, _, _ = _sequential(client, prompts[0])
    done = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=NEW,
                                     extra_body={"return_token_ids": True, "stop": [ids[2]]})
    assert done.choices[0].token_ids == ids[: ids.index(ids[2]) + 1] and done.choices[0].finish_reason == "stop"


def test_a_disconnect_frees_the_slot(server, prompts):
    scheduler = server.state.scheduler
    aborted = scheduler.metrics.finished["abort"]
    body = {"prompt": prompts[1], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert _wait(lambda: scheduler._active)
    assert _wait(lambda: scheduler.metrics.finished["abort"] == aborted + 1 and not scheduler._active)
    assert sorted(scheduler._free) == list(range(scheduler.max_batch))


def test_bad_requests_do_not_stop_the_server(server, client, prompts):
    for body in (b"{", b'{"prompt": [1, 99999]}', b'{"prompt": [1], "max_tokens": -5}'):
        assert httpx.post(f"{server.url}/v1/completions", content=body).status_code == 400
    assert _sequential(client, prompts[0])[1] in ("length", "stop")


def test_chat_stream_equals_non_stream(client):
    tokenizer = k3_tokenizer(load_tokenizer(GOLDEN_DIR))
    request = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi!"}], "max_tokens": 12}
    extra = {"return_token_ids": True, "chat_template_kwargs": {"thinking": False}}
    done = client.chat.completions.create(**request, extra_body=extra)
    choice = done.choices[0]
    reply = parse_reply(tokenizer, choice.token_ids, thinking=False)
    assert choice.message.content == reply.content and choice.message.reasoning_content is None
    assert done.usage.completion_tokens == len(choice.token_ids)
    chunks = list(client.chat.completions.create(**request, stream=True, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_shutdown_drains_in_flight_requests(server, client, prompts):
    """Stopping the server lets a running stream finish; then it takes no connections."""
    result: dict = {}

    def stream() -> None:
        result["ids"], result["reasons"] = _streamed(client, prompts[3], 40, ignore_eos=True)

    reader = threading.Thread(target=stream)
    reader.start()
    assert _wait(lambda: server.state.scheduler._active)
    server.stop()
    reader.join(120)
    assert len(result["ids"]) == 40 and result["reasons"][-1] == "length"
    assert not server.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")

