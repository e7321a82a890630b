"""k3jax.tokenizer on a synthetic Kimi-format tokenizer directory (a few hundred BPE ranks) and the
byte-level fallback."""

from __future__ import annotations

import base64
import json

import pytest

from k3jax.tokenizer import (
    KIMI_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    ByteTokenizer,
    TiktokenTokenizer,
    load_tiktoken_ranks,
    load_tokenizer,
)

MERGES = [b"th", b"the", b" the", b"he", b"ll", b"llo", b"hello", b" w", b" wo", b"or", b"rld", b" world",
          b"in", b"ing", b"er", b" a", b" an", b" and", b"\xe4\xbd", b"\xe4\xbd\xa0", b"\xe5\xa5", b"\xe5\xa5\xbd"]
# 256 bytes + 22 merges + more 2-byte merges of lowercase letters: a few hundred ranks.
EXTRA = [bytes([a, b]) for a in b"aeiou" for b in b"bcdfghklmnprstvwxyz" if bytes([a, b]) not in MERGES]
SPECIAL = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>", 4: "<|im_user|>", 5: "<|im_assistant|>", 7: "<|im_system|>",
           8: "<|im_middle|>", 255: "[PAD]"}  # offsets from the number of BPE ranks


def _write_tokenizer_dir(path):
    tokens = [bytes([b]) for b in range(256)] + MERGES + EXTRA
    (path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)), encoding="ascii"
    )
    n = len(tokens)
    config = {
        "added_tokens_decoder": {str(n + k): {"content": v, "special": True} for k, v in SPECIAL.items()},
        "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "pad_token": "[PAD]",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return n


@pytest.fixture
def kimi_dir(tmp_path):
    return tmp_path, _write_tokenizer_dir(tmp_path)


def test_loads_ranks_and_special_tokens(kimi_dir):
    path, n = kimi_dir
    assert 300 < n < 400
    assert load_tiktoken_ranks(path / "tiktoken.model")[b" world"] == 256 + MERGES.index(b" world")
    tok = load_tokenizer(path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == n + NUM_RESERVED_SPECIAL_TOKENS
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 255)
    assert tok.special_tokens["<|im_middle|>"] == n + 8
    assert tok.special_tokens["<|reserved_token_%d|>" % (n + 2)] == n + 2  # unnamed reserved slot


def test_encode_decode_round_trip(kimi_dir):
    tok = load_tokenizer(kimi_dir[0])
    assert tok.encode("hello the world") == [256 + MERGES.index(t) for t in (b"hello", b" the", b" world")]
    for text in ["hello the world", "Tokens and strings: 123,4567!\n\n  tabs\tand UPPER lower", "你好，世界 🌍 café",
                 "", " " * 40 + "x"]:
        ids = tok.encode(text)
        assert all(0 <= i < kimi_dir[1] for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode_bytes(tok.encode("你好")) == "你好".encode()


def test_special_tokens_in_text(kimi_dir):
    """Special-token strings are control tokens only in trusted text (allow_special=True); by default
    they are ordinary text."""
    tok = load_tokenizer(kimi_dir[0])
    n = kimi_dir[1]
    ids = tok.encode("[BOS]hello<|im_end|>", allow_special=True)
    assert ids == [n, 256 + MERGES.index(b"hello"), n + 3]
    assert tok.decode(ids) == "[BOS]hello<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hello"
    plain = tok.encode("[BOS]hello")
    assert all(i < n for i in plain) and tok.decode(plain) == "[BOS]hello"


def test_kimi_pre_tokenizer_splits_han_apart(kimi_dir):
    """Kimi's regex (tiktoken dialect, set intersections included) compiles and keeps Han runs apart."""
    tok = load_tokenizer(kimi_dir[0])
    assert tok.encoding._pat_str == KIMI_PAT_STR
    pieces = [tok.decode_bytes([i]) for i in tok.encode("你好hello")]
    assert b"".join(pieces) == "你好hello".encode()
    assert pieces[-1] == b"hello"  # a separate pre-token, merged whole


def test_long_runs_are_split_but_round_trip(kimi_dir):
    tok = load_tokenizer(kimi_dir[0])
    text = "a" * 30_000 + " hello"
    assert tok.decode(tok.encode(text)) == text


def test_bad_rank_file(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not-base64!! 0\n", encoding="ascii")
    with pytest.raises(ValueError, match="tiktoken.model:1"):
        load_tokenizer(tmp_path)


def test_byte_fallback_round_trip(tmp_path):
    tok = load_tokenizer(tmp_path)  # no tiktoken.model, no config.json
    assert isinstance(tok, ByteTokenizer)
    text = "Grüße, 世界! 🌍\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a cut UTF-8 character


def test_byte_fallback_reads_special_ids_from_config(golden_dir):
    tok = load_tokenizer(golden_dir)  # the tiny checkpoint: no tokenizer files, bos 256 / eos 258 / pad 511
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (256, 258, 511)
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id]) == "hi"


def test_byte_fallback_named_specials():
    tok = ByteTokenizer(bos_id=256, eos_id=257, special_tokens={"<s>": 256, "</s>": 257})
    ids = tok.encode("<s>ok</s>", allow_special=True)
    assert ids == [256, ord("o"), ord("k"), 257] and tok.encode("<s>") == list(b"<s>")
    assert tok.decode(ids) == "<s>ok</s>" and tok.decode(ids, skip_special_tokens=True) == "ok"
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer(special_tokens={"<x>": 3})
