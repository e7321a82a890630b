"""Chat on the tiny golden model: each turn continues from the cache of the last one (no re-prefill),
and produces exactly what one `k3jax.generate` over the whole conversation so far produces (greedy)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
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


class ScriptedChat(Chat):
    """A Chat whose replies are given (the model still runs every token): checks the bookkeeping."""

    def __init__(self, *args, replies, **kwargs):
        super().__init__(*args, **kwargs)
        self.replies, self.script = list(replies), []

    def send(self, text, **kwargs):
        ids, mask = encode_for_training(self.tokenizer, [self.replies.pop(0)], thinking=self.thinking)
        self.script = [i for i, m in zip(ids, mask) if m]  # what the model would write after the prompt
        return super().send(text, **kwargs)

    def _next_token(self, logits, key):
        return self.script.pop(0)


def test_history_reencodes_as_the_messages(golden_model_fp32, monkeypatch):
    """Replies in the grammar, the first cut off at max_new_tokens and closed: the token history is the
    messages' encoding. Same system, thinking and first message as above: the compiled prefill is reused."""
    tok, counter = byte_tokenizer(), CountingPrefill(monkeypatch)
    chat = ScriptedChat(golden_model_fp32, tok, system="Be brief.", thinking="high", max_new_tokens=45,
                        temperature=0.0, replies=[AssistantMessage("", "x" * 60), AssistantMessage("Hi!", "Go.")])
    replies = [chat.send(text) for text in ("Hi", "Why?")]
    assert [(r.reasoning, r.content, r.finished) for r in replies] == [("x" * 45, "", False), ("Go.", "Hi!", True)]
    assert chat.messages[2::2] == [AssistantMessage("", "x" * 45), AssistantMessage("Hi!", "Go.")]
    assert chat.token_ids == encode_messages(tok, chat.messages, thinking="high", add_generation_prompt=False)
    assert chat.cache_length == len(chat.token_ids) - 1 and len(counter.calls) == 1
    chat.reset()
    assert (chat.messages, chat.token_ids, chat.cache_length) == ([SystemMessage("Be brief.")], [], 0)


class FakeCache(NamedTuple):
    length: int
    capacity: int


class FakeModelCalls:
    """prefill / extend / decode_step that only count tokens against the capacity (no model runs), so the
    capacity policy is checked without compiling anything."""

    def __init__(self, monkeypatch, vocab):
        self.prefills, self.extends, self.vocab = [], [], vocab
        for name in ("prefill", "extend", "decode_step"):
            monkeypatch.setattr(session_module, name, getattr(self, name))

    def prefill(self, model, ids, *, capacity, pixel_values=None, grid_thws=None):
        """Counts the placeholders as the model expands them: (h/2)(w/2) positions per image."""
        length = ids.shape[1] + (0 if grid_thws is None else int((grid_thws[:, 1] * grid_thws[:, 2] // 4 - 1).sum()))
        assert length <= capacity
        self.prefills.append((ids.shape[1], capacity) if grid_thws is None else (ids.shape[1], capacity, len(grid_thws)))
        return jnp.zeros((1, length, self.vocab)), FakeCache(length, capacity)

    def extend(self, model, cache, ids, real_tokens):
        assert cache.length + ids.shape[1] <= cache.capacity, "extend past the capacity"
        self.extends.append((ids.shape[1], real_tokens))
        return jnp.zeros((1, self.vocab)), FakeCache(cache.length + real_tokens, cache.capacity)

    def decode_step(self, model, cache, tokens):
        assert cache.length < cache.capacity, "decode_step on a full cache"
        return jnp.zeros((1, self.vocab)), FakeCache(cache.length + 1, cache.capacity)


def test_the_cache_grows_when_full(golden_model_fp32, monkeypatch):
    """Capacities in steps of 64: a turn that does not fit (with room for max_new_tokens) gets a cache
    twice as large, or what it needs if more, filled once with the whole conversation; a turn that fits
    only extends."""
    tok, calls = byte_tokenizer(), FakeModelCalls(monkeypatch, golden_model_fp32.config.vocab_size)
    monkeypatch.setattr(session_module, "CAPACITY_STEP", 64)
    replies = [AssistantMessage("Hello!"), AssistantMessage("Fine."), AssistantMessage("y" * 35),
               AssistantMessage("z"), AssistantMessage("w" * 300)]
    chat = ScriptedChat(golden_model_fp32, tok, thinking=None, max_new_tokens=400, temperature=0.0, replies=replies)
    seen = set()
    for text in ("Hi", "Ok", "Long", "Again", "x" * 500):
        cached, cap, before = chat.cache_length, chat.cache_capacity, len(calls.prefills)
        reply = chat.send(text)
        prompt = len(chat.token_ids) - len(reply.token_ids)  # the conversation up to this reply
        needed = prompt + 400
        if cap and needed <= cap:
            seen.add("extended")
            assert len(calls.prefills) == before and chat.cache_capacity == cap
        else:
            seen.add("grown" if cap else "first")
            assert calls.prefills[before:] == [(prompt, -(-max(needed, 2 * cap) // 64) * 64)]
        assert chat.cache_length == len(chat.token_ids) - 1 and chat.cache_length > cached
    assert seen == {"first", "extended", "grown"}
    # turns are right-padded to powers of two from 16 (fewer compiled shapes), unpadded only where
    # the padding would not fit the cache
    assert calls.extends and all(width == max(16, 1 << (real - 1).bit_length()) for width, real in calls.extends)
    assert chat.token_ids == encode_messages(tok, chat.messages, thinking=None, add_generation_prompt=False)


def test_an_interrupted_turn_leaves_the_conversation_as_it_was(golden_model_fp32, monkeypatch):
    tok, calls = byte_tokenizer(), FakeModelCalls(monkeypatch, golden_model_fp32.config.vocab_size)
    chat = ScriptedChat(golden_model_fp32, tok, thinking="high", max_new_tokens=50, temperature=0.0,
                        replies=[AssistantMessage("One."), AssistantMessage("Two, long."), AssistantMessage("Three.")])
    chat.send("Hi")
    before = (list(chat.messages), list(chat.token_ids))

    def interrupt(channel, text):
        if channel == "content":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.send("Next", on_text=interrupt)
    assert (chat.messages, chat.token_ids, chat.cache_length) == (*before, 0)
    chat.send("Next")  # the dropped cache: the conversation is prefilled once, then goes on
    assert calls.prefills[-1][0] == len(before[1]) + len(encode_turn(tok, [UserMessage("Next")], thinking="high"))
    assert chat.messages[-1] == AssistantMessage("Three.", "")
    assert chat.token_ids == encode_messages(tok, chat.messages, thinking="high", add_generation_prompt=False)
