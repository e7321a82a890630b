"""The routes' reading of replies, with a scripted engine (no model): chat replies split into
reasoning, content and tool calls, streamed and not; stop strings; what the engine is asked for."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from k3jax.chat import (
    AssistantMessage, ToolCall, UserMessage, control_ids, encode_for_training, encode_messages, k3_tokenizer,
)
from k3jax.serving.app import create_app
from k3jax.serving.metrics import Metrics
from k3jax.serving.request import Finish, GenerationRequest
from k3jax.serving.state import ServerState
from k3jax.tokenizer import load_tokenizer
from tests.conftest import GOLDEN_DIR

MAX_LEN = 4096
TOKENIZER = load_tokenizer(GOLDEN_DIR)
CHAT = k3_tokenizer(TOKENIZER)
REPLY = AssistantMessage("It is sunny.", "Let me look it up.", (ToolCall("weather", {"city": "Paris", "days": 3}),))


class Scripted:
    """Stands in for the engine: every request gets `reply` (up to its budget or a stop token)."""

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.requests, self.metrics = reply, [], Metrics(1)

    def submit(self, req: GenerationRequest, sink):
        self.requests.append(req)
        count, reason = 0, "length"
        for token in self.reply[: req.max_tokens]:
            sink.token(token)
            count += 1
            if token in req.stop_ids:
                reason = "stop"
                break
        sink.finish(Finish(reason, len(req.prompt), count, 0))
        return self

    def cancel(self) -> None:
        pass


def _client(reply: list[int]) -> tuple[TestClient, Scripted]:
    engine = Scripted(reply)
    state = ServerState(engine, TOKENIZER, CHAT, "tiny", 512, MAX_LEN, 258, 256, 0)
    return TestClient(create_app(state, start_engine=False)), engine


def _reply_ids(message: AssistantMessage) -> list[int]:
    ids, mask = encode_for_training(CHAT, [message])
    return [i for i, m in zip(ids, mask) if m]


@pytest.fixture(scope="module")
def chat():
    client, engine = _client(_reply_ids(REPLY))
    with client:
        yield client, engine


def _events(response) -> list[dict]:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_chat_reply_is_parsed(chat):
    client, engine = chat
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "reasoning_effort": "low",
                                                    "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and body["object"] == "chat.completion"
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (REPLY.reasoning, REPLY.content)
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["token_ids"] == _reply_ids(REPLY)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    req = engine.requests[-1]
    assert list(req.prompt) == encode_messages(CHAT, [UserMessage("Weather in Paris?")], thinking="low")
    assert control_ids(CHAT).end_of_msg in req.stop_ids and req.max_tokens == MAX_LEN - len(req.prompt)


def test_chat_stream_carries_the_same_reply(chat):
    client, _ = chat
    events = _events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Weather?"}], "stream": True,
        "stream_options": {"include_usage": True}}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant" and all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REPLY.reasoning
    assert "".join(d.get("content", "") for d in deltas) == REPLY.content
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ())] == ["weather"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(_reply_ids(REPLY))


def test_chat_without_thinking(chat):
    client, engine = chat
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                              "chat_template_kwargs": {"thinking": False}})
    assert list(engine.requests[-1].prompt) == encode_messages(CHAT, [UserMessage("x")], thinking=None)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(stream):
    client, _ = _client([256 + 100, *b"Hello STOP world", 258])
    with client:
        response = client.post("/v1/completions", json={"prompt": "hi", "stop": ["STOP"], "stream": stream,
                                                        "max_tokens": 30})
    if stream:
        choices = [e["choices"][0] for e in _events(response)]
        text, reason = "".join(c["text"] for c in choices), choices[-1]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        text, reason = choice["text"], choice["finish_reason"]
    assert (text, reason) == ("Hello ", "stop")


def test_eos_ends_the_completion_and_is_not_text():
    client, engine = _client([*b"ok", 258, *b"more"])
    with client:
        body = client.post("/v1/completions", json={"prompt": [1, 2], "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("ok", [111, 107, 258], "stop")
    assert engine.requests[-1].max_tokens == 16 and engine.requests[-1].prompt == (1, 2)
