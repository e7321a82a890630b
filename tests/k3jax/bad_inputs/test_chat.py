"""Bad inputs to k3jax.chat: tokenizers that are not K3's, bad options, messages and values. Each case is
a row; add rows to extend."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from k3jax.chat import (
    AssistantMessage, ImagePart, ToolCall, ToolMessage, UserMessage, control_ids, encode_messages, k3_tokenizer,
    messages_from_dicts,
)
from k3jax.chat.repl import _loop
from k3jax.chat.session import Chat
from k3jax.cli import main
from k3jax.tokenizer import ByteTokenizer, load_tokenizer
from tests.k3jax.chat.helpers import GOLDEN_DIR, bpe_tokenizer
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
    ({}, [AssistantMessage("", tool_calls=(ToolCall("f", '{"a": 1}'),))], TypeError,
     r"messages\[0\].tool_calls\[0\]: expected a string name and arguments as a dict or RawArguments, got str and str"),
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


@pytest.mark.parametrize("flags, message", [
    (["--thinking", "medium"], r"--thinking: invalid choice: 'medium'"),
    (["--temperature", "-1"], r"--temperature: expected a number >= 0"),
    (["--temperature", "nan"], r"--temperature: expected a number >= 0"),
    (["--seed", "-3"], r"--seed: expected an integer >= 0"),
    (["--seed", str(2**32)], r"--seed: expected an integer in \[0, 2\*\*32 - 1\]"),
    (["--max-new-tokens", "0"], r"--max-new-tokens: expected an integer >= 1"),
    (["--system", "caf\udce9"], r"--system: the system message is not valid UTF-8: byte 0xe9"),
])
def test_chat_command_options_are_checked_first(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--model", "/nonexistent", *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_chat_command_checks_the_checkpoint_before_loading(tmp_path, capsys, golden_dir):
    assert main(["chat", "--model", str(tmp_path / "missing")]) == 1
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_bytes((golden_dir / "config.json").read_bytes())
    _write_tokenizer_dir(tmp_path)  # a K2-style tokenizer beside the tiny config: refused before any weight loads
    assert main(["chat", "--model", str(tmp_path)]) == 1
    assert "but K3's is '<|open|>'" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"thinking": "medium"}, r"thinking='medium': expected one of low, high, max, or None"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0: expected an integer >= 1"),
    ({"max_new_tokens": 2.0}, r"max_new_tokens=2.0: expected an integer >= 1"),
    ({"seed": -1}, r"seed=-1: expected an integer >= 0"),
    ({"seed": 2**32}, r"seed=4294967296: expected an integer in \[0, 2\*\*32 - 1\]"),
    ({"temperature": -0.5}, r"temperature=-0.5: expected a finite number >= 0"),
    ({"top_p": 0}, r"top_p=0: expected 0 < top_p <= 1"),
    ({"capacity": 0}, r"capacity=0: expected an integer >= 1"),
    ({"system": "caf\udce9"}, r"system is not valid UTF-8: byte 0xe9"),
])
def test_bad_chat_settings(golden_model_fp32, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Chat(golden_model_fp32, k3_tokenizer(load_tokenizer(GOLDEN_DIR)), **kwargs)


def test_chat_model_and_tokenizer_must_belong_together(golden_model_fp32):
    with pytest.raises(ValueError, match=r"the model's eos_token_id=258 is not the tokenizer's <\|end_of_msg\|> \(\d+\)"):
        Chat(golden_model_fp32, bpe_tokenizer())
    with pytest.raises(TypeError, match=r"text: expected a string, got int"):
        Chat(golden_model_fp32, k3_tokenizer(load_tokenizer(GOLDEN_DIR))).send(3)


def test_chat_command_checks_images_before_loading(tmp_path, capsys, golden_dir):
    assert main(["chat", "--model", str(golden_dir), "--image", str(tmp_path / "none.png")]) == 2
    assert f"image file {tmp_path / 'none.png'} does not exist" in capsys.readouterr().err
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert main(["chat", "--model", str(golden_dir), "--image", str(tmp_path / "bad.png")]) == 2
    assert f"cannot decode image file {tmp_path / 'bad.png'}" in capsys.readouterr().err
    config = json.loads((golden_dir / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["chat", "--model", str(tmp_path), "--image", str(tmp_path / "bad.png")]) == 2
    assert "has no vision_config (a text-only model)" in capsys.readouterr().err


def test_chat_repl_commands_without_a_reply(golden_model_fp32, monkeypatch, capsys, tmp_path):
    """Lines that never reach the model: unknown commands, /image errors, blank lines, then /exit."""
    chat = Chat(golden_model_fp32, k3_tokenizer(load_tokenizer(GOLDEN_DIR)))
    lines = ["/help", f"/image {tmp_path / 'none.png'}", "   ", "/exit", "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert _loop(chat, [], has_vision=True, out=sys.stdout) == 0
    out = capsys.readouterr().out
    assert "unknown command /help (/image PATH attaches" in out
    assert f"error: image file {tmp_path / 'none.png'} does not exist" in out
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {tmp_path / 'none.png'}\n"))
    assert _loop(chat, [], has_vision=False, out=sys.stdout) == 0
    assert "error: this model has no vision tower" in capsys.readouterr().out
