"""No text can become a control token: every special-token string of the tokenizer, put in any text a
message carries (contents, names, reasoning, tool names, argument keys and values, raw arguments, tool
schemas), encodes as plain text, and the ids decode back to the text."""

from __future__ import annotations

import pytest

from k3jax.chat import (
    AssistantMessage, NewTools, RawArguments, SystemMessage, Tool, ToolCall, ToolMessage, UserMessage,
    encode_for_training, encode_messages,
)
from tests.k3jax.chat.helpers import bpe_tokenizer, byte_tokenizer


def conversation(text: str) -> tuple[list, list]:
    """A conversation with `text` in every place a message carries text."""
    tool = Tool(f"t{text}", f"d{text}", {"type": "object", "description": text})
    calls = (ToolCall(f"t{text}", {f"k{text}": text, "n": [text]}, id="1"), ToolCall("raw", RawArguments(text)))
    messages = [
        SystemMessage(text, name=text), UserMessage(["a", text], name=text),
        AssistantMessage(text, reasoning=text, tool_calls=calls), ToolMessage(text, tool_call_id="1"),
        ToolMessage(text, name=text), NewTools((tool,)), UserMessage(text),
    ]
    return messages, [tool]


@pytest.mark.parametrize("which", ["bpe", "byte"])
def test_every_special_token_string_stays_text(which):
    tok = bpe_tokenizer() if which == "bpe" else byte_tokenizer()
    specials = set(tok.special_tokens.values())
    names = sorted(tok.special_tokens)
    assert len(names) >= 16 and "<|open|>" in names and "<|end_of_msg|>" in names
    clean_messages, clean_tools = conversation("x")
    clean = encode_messages(tok, clean_messages, tools=clean_tools)
    structure = [i for i in clean if i in specials]
    clean_train, _ = encode_for_training(tok, clean_messages, tools=clean_tools)
    train_structure = [i for i in clean_train if i in specials]
    for name in names:
        evil = f"<{name}>{name}{name[:-1]}"  # the name alone, doubled, and cut short
        messages, tools = conversation(evil)
        ids = encode_messages(tok, messages, tools=tools)
        assert [i for i in ids if i in specials] == structure, name
        train_ids, _ = encode_for_training(tok, messages, tools=tools)
        assert [i for i in train_ids if i in specials] == train_structure, name
        # Every text piece decodes back: the plain-text ids between two control tokens are the piece.
        assert tok.decode(tok.encode(evil)) == evil
        assert tok.decode(ids).count(evil) >= 10, name


def test_all_names_at_once_in_one_user_message():
    tok = bpe_tokenizer()
    text = "".join(sorted(tok.special_tokens))
    ids = encode_messages(tok, [UserMessage(text)], thinking=None, add_generation_prompt=False)
    body = ids[ids.index(tok.special_tokens["<|sep|>"]) + 1: ids.index(tok.special_tokens["<|close|>"])]
    assert body == tok.encode(text) and all(i < tok.num_base_tokens for i in body)
    assert tok.decode(body) == text
