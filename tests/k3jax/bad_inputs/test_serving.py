"""Bad requests to `k3jax serve`: each row is a request and the OpenAI error it must get. The app runs
without its engine (Starlette's test client), so nothing compiles: every row is refused before it is
queued. Then bad engine arguments (`Scheduler`). Add rows to extend."""

from __future__ import annotations

import argparse
import re

import pytest
from starlette.testclient import TestClient

from k3jax.serving.app import create_app
from k3jax.serving.command import build_state
from k3jax.serving.scheduler import Scheduler
from tests.conftest import GOLDEN_DIR

MAX_LEN = 64


def _client(**flags) -> TestClient:
    args = argparse.Namespace(model=GOLDEN_DIR, mesh=None, dtype="float32", layers="auto", max_batch=2, max_len=MAX_LEN,
                              prefill_chunk=16, max_prefill_tokens=64, max_queue=8, prefix_cache_mib=0,
                              served_model_name="tiny")
    for key, value in flags.items():
        setattr(args, key, value)
    return TestClient(create_app(build_state(args), start_engine=False))


@pytest.fixture(scope="module")
def client():
    with _client() as c:
        yield c


COMPLETIONS = [
    (b"{bad json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    ({"prompt": [1, 512]}, 400, "prompt", r"outside the vocabulary \[0, 512\): \[512\]"),
    ({"prompt": [1, -1]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": [1, True]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": [1.5]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": []}, 400, "prompt", "non-empty list"),
    ({"prompt": ""}, 400, "prompt", "'prompt' is empty"),
    ({"prompt": {"a": 1}}, 400, "prompt", "a string or a list of token ids"),
    ({"prompt": [1], "max_tokens": -1}, 400, "max_tokens", r"integer in \[1, "),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens", r"integer in \[1, "),
    ({"prompt": [1], "max_tokens": 2.5}, 400, "max_tokens", r"integer in \[1, "),
    ({"prompt": [1, 2], "max_tokens": MAX_LEN - 1}, 400, "max_tokens", "too large: the prompt has 2 tokens"),
    ({"prompt": [1] * MAX_LEN}, 400, "prompt", f"the prompt has {MAX_LEN} tokens; this server takes at most"),
    ({"prompt": [1], "temperature": -0.1}, 400, "temperature", "must be a number >= 0"),
    ({"prompt": [1], "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p", "must be a number > 0 and <= 1"),
    ({"prompt": [1], "top_k": 1000}, 400, "top_k", r"integer in \[1, 512\]"),
    ({"prompt": [1], "seed": -3}, 400, "seed", "integer in"),
    ({"prompt": [1], "seed": 2**40}, 400, "seed", "integer in"),
    ({"prompt": [1], "stop": [""]}, 400, "stop", "non-empty string"),
    ({"prompt": [1], "stop": [600]}, 400, "stop", "a token id in"),
    ({"prompt": [1], "stop": ["a"] * 17}, 400, "stop", "at most 16"),
    ({"prompt": [1], "stream": "yes"}, 400, "stream", "must be a boolean"),
    ({"prompt": [1], "n": 2}, 400, "n", "is not supported"),
    ({"prompt": [1], "echo": True}, 400, "echo", "is not supported"),
    ({"prompt": [1], "logprobs": 3}, 400, "logprobs", "is not supported"),
    ({"prompt": [1], "return_token_ids": 1}, 400, "return_token_ids", "must be a boolean"),
    ({"prompt": [1], "model": "gpt-4"}, 404, "model", "does not exist; this server serves 'tiny'"),
]


@pytest.mark.parametrize("body, status, param, message", COMPLETIONS)
def test_completions(client, body, status, param, message):
    response = client.post("/v1/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


CHAT = [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"content": "hi"}]}, "messages", "string 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "width": 4, "height": 4}]}]}, "messages",
     "images are not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "medium"}, "reasoning_effort",
     "must be one of low, high, max"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": "no"}},
     "chat_template_kwargs", "must be a boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}, "tool_choice",
     "must be \"auto\""),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "tools", "must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format",
     "must be"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     r"integer in \[1, "),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "prompt", "this server takes at most"),
]


@pytest.mark.parametrize("body, param, message", CHAT)
def test_chat(client, body, param, message):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_unknown_route_is_an_openai_404(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_full_queue_is_503():
    with _client(max_queue=0) as full:
        response = full.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["type"] == "server_busy"


SCHEDULER = [
    (dict(max_prefill_tokens=0), r"max_prefill_tokens=0: expected an integer >= 1"),
    (dict(max_prefill_tokens=-512), r"max_prefill_tokens=-512: expected an integer >= 1"),
    (dict(max_prefill_tokens=1024.0), r"max_prefill_tokens=1024.0: expected an integer >= 1"),
    (dict(max_prefill_tokens=True), r"max_prefill_tokens=True: expected an integer >= 1"),
    (dict(max_batch=0), r"max_batch=0: expected an integer >= 1"),
    (dict(prefill_chunk=0), r"prefill_chunk=0: expected an integer >= 1"),
    (dict(headroom=0), r"headroom=0: expected an integer >= 1"),
    (dict(max_queue=-1), r"max_queue=-1: expected an integer >= 0"),
]


@pytest.mark.parametrize("flags, message", SCHEDULER)
def test_scheduler_arguments(golden_model_fp32, flags, message):
    """The engine's own arguments are checked before any cache is allocated."""
    with pytest.raises(ValueError, match=message):
        Scheduler(golden_model_fp32, **{"max_batch": 2, "max_len": MAX_LEN, **flags})
