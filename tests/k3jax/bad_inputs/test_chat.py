"""Bad inputs to k3jax.chat: tokenizers that are not K3's, bad options, messages and values. Each case is
a row; add rows to extend."""

from __future__ import annotations

import pytest

from k3jax.chat import (
    AssistantMessage, ImagePart, ToolCall, ToolMessage, UserMessage, control_ids, encode_messages, k3_tokenizer,
    messages_from_dicts,
)
from k3jax.tokenizer import ByteTokenizer, load_tokenizer
from tests.k3jax.chat.helpers import bpe_tokenizer
from tests.k3jax.test_tokenizer import _write_tokenizer_dir


def test_a_k2_tokenizer_is_refused(tmp_path):
    n = _write_tokenizer_dir(tmp_path)  # names n+3 "<|im_end|>", K2-style
    with pytest.raises(ValueError, match=rf"names special id {n + 3} '<\|im_end\|>', but K3's is '<\|open\|>'"):
        control_ids(load_tokenizer(tmp_path))


@pytest.mark.parametrize("tokenizer, message", [
    (ByteTokenizer(vocab_size=300), r"vocabulary has 300 ids; K3's chat format needs .* \(vocab_size >= 512\)"),
    (ByteTokenizer(eos_id=257, vocab_size=512), r"eos_id=257, but K3's <\|end_of_msg\|> is id 258"),
    (ByteTokenizer(bos_id=300, vocab_size=512), r"bos_id=300, but K3's \[BOS\] is id 256"),
    ("not a tokenizer", r"expected a k3jax tokenizer"),
])
def test_tokenizers_without_k3_specials(tokenizer, message):
    with pytest.raises((ValueError, TypeError), match=message):
        k3_tokenizer(tokenizer)


@pytest.mark.parametrize("kwargs, messages, error, message", [
    ({"thinking": "medium"}, [UserMessage("x")], ValueError, r"thinking='medium': expected one of low, high, max"),
    ({"thinking": True}, [UserMessage("x")], ValueError, r"thinking=True"),
    ({"tool_choice": "any"}, [UserMessage("x")], ValueError, r"tool_choice='any': expected one of auto"),
    ({"response_format": {"type": "json_object"}}, [UserMessage("x")], TypeError, r"response_format: expected a"),
    ({"tools": [{"type": "function"}]}, [UserMessage("x")], TypeError, r"tools\[0\]: expected a Tool, got dict"),
    ({}, [{"role": "user", "content": "x"}], TypeError, r"messages\[0\]: expected one of .* got dict .*messages_from_dicts"),
    ({}, "hello", TypeError, r"messages: expected a list of messages, got str"),
    ({}, [UserMessage(["a", 3])], TypeError, r"messages\[0\].content\[1\]: expected a string or ImagePart, got int"),
    ({}, [UserMessage(3)], TypeError, r"messages\[0\].content: expected a string or a list"),
    ({}, [AssistantMessage("", tool_calls=(ToolCall("f", {"k": object()}),))], ValueError,
     r"messages\[0\].tool_calls\[0\].arguments\['k'\]: expected a JSON value, got object"),
    ({}, [AssistantMessage("", tool_calls=("f",))], TypeError, r"messages\[0\].tool_calls\[0\]: expected a ToolCall"),
    ({}, [ToolMessage("r")], ValueError, r"messages\[0\]: a tool result with no tool name"),
    ({}, [UserMessage("caf\udce9")], ValueError, r"not valid UTF-8: byte 0xe9"),
])
def test_bad_options_and_messages(kwargs, messages, error, message):
    with pytest.raises(error, match=message):
        encode_messages(bpe_tokenizer(), messages, **kwargs)


@pytest.mark.parametrize("dicts, message", [
    ([{"content": "x"}], r"messages\[0\]: expected a dict with a string 'role'"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"messages\[0\].content\[0\]: expected a text or image part"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\].content\[0\]: an image part needs"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "3"}}]}],
     r"tool call 'f': arguments must be a JSON object; got int"),
    ([{"role": "system", "tools": [{"function": {}}], "content": ""}], r"tools\[0\]: expected"),
])
def test_bad_openai_dicts(dicts, message):
    with pytest.raises(ValueError, match=message):
        messages_from_dicts(dicts)


@pytest.mark.parametrize("width, height", [(0, 5), (5, -1), (True, 5), (2.5, 3)])
def test_bad_image_sizes(width, height):
    with pytest.raises(ValueError, match=r"ImagePart\.(width|height)=.*expected a positive integer"):
        ImagePart(width, height)
