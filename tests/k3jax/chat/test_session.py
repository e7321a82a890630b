"""Chat on the tiny golden model: each turn continues from the cache of the last one (no re-prefill),
and produces exactly what one `k3jax.generate` over the whole conversation so far produces (greedy)."""

from __future__ import annotations

import numpy as np
import pytest

import k3jax
from k3jax.chat import AssistantMessage, SystemMessage, UserMessage, encode_for_training, encode_messages, encode_turn
from k3jax.chat import session as session_module
from k3jax.chat.parsing import ReplyParser
from k3jax.chat.session import Chat
from tests.k3jax.chat.helpers import byte_tokenizer

E = 258  # <|end_of_msg|> of the tiny checkpoint


class CountingPrefill:
    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(session_module, "prefill", self)

    def __call__(self, model, ids, **kwargs):
        self.calls.append((ids.shape[1], kwargs["capacity"]))
        return k3jax.prefill(model, ids, **kwargs)


def reference(model, prefix, max_new_tokens):
    """Greedy generate over the whole conversation so far, cut after its stop token."""
    out = k3jax.generate(model, np.asarray([prefix], np.int32), max_new_tokens=max_new_tokens, stop_tokens=[E],
                         capacity=1024, on_token=lambda tokens: None, return_lengths=True)
    return tuple(int(t) for t in np.asarray(out.tokens[0, : int(out.lengths[0])]))


def test_turns_continue_the_cache_and_match_generate(golden_model_fp32, monkeypatch):
    tok, counter = byte_tokenizer(), CountingPrefill(monkeypatch)
    chat = Chat(golden_model_fp32, tok, system="Be brief.", thinking="high", max_new_tokens=6, temperature=0.0)
    streamed = []
    first = chat.send("Hi", on_text=lambda channel, text: streamed.append((channel, text)))
    prompt1 = encode_messages(tok, [SystemMessage("Be brief."), UserMessage("Hi")], thinking="high")
    assert first.token_ids == reference(golden_model_fp32, prompt1, 6)
    assert "".join(t for c, t in streamed if c == "reasoning") == first.reasoning
    assert chat.cache_length == len(prompt1) + len(first.token_ids) - 1  # the last token waits for the next turn
    length1 = chat.cache_length

    history1 = list(chat.token_ids)
    closing1 = ReplyParser(tok, thinking=True)
    closing1.feed(first.token_ids)
    assert history1 == prompt1 + list(first.token_ids) + closing1.closing_ids()

    second = chat.send("More?")
    prefix2 = history1 + encode_turn(tok, [UserMessage("More?")], thinking="high")
    assert second.token_ids == reference(golden_model_fp32, prefix2, 6)
    assert counter.calls == [(len(prompt1), 1024)]  # one prefill: the second turn only extended the cache
    assert chat.cache_length == len(prefix2) + len(second.token_ids) - 1  # grew by the new turn's ids only
    assert chat.messages[:3] == [SystemMessage("Be brief."), UserMessage("Hi"), AssistantMessage(
        first.content, first.reasoning, first.tool_calls)] and chat.messages[3] == UserMessage("More?")
