"""Tokenizers for the chat tests, and `xtml`: expected ids written as the rendered string.

`xtml(tok, '<|open|>message¦ role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>')` is the ids
of that rendering: each control-token name is its K3 id, every other stretch of text is encoded on its
own, and "¦" marks where the release starts a new text piece inside a stretch (BPE never merges
across a piece)."""

from __future__ import annotations

import re
from pathlib import Path

from k3jax.chat.tokens import K3_SPECIAL_OFFSETS, RESERVED, k3_special_tokens, k3_tokenizer
from k3jax.tokenizer import TiktokenTokenizer, load_tokenizer

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden" / "k3-tiny-a"
# Merged words: the test BPE turns each into one token (through its prefixes), so a wrong piece boundary
# or a missing piece changes the ids.
WORDS = ["message", " role", "=\"", "user", "system", "assistant", "think", "response", "tools", "call",
         "argument", " key", " type", " tool", " index", "Helloworld", "Hello", "world", "image", "json"]


def bpe_tokenizer() -> TiktokenTokenizer:
    """A small tiktoken BPE (256 bytes + merges of WORDS) with K3's special tokens after its ranks."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in WORDS:
        data = word.encode()
        for end in range(2, len(data) + 1):
            ranks.setdefault(data[:end], len(ranks))
    n = len(ranks)
    names = {i: name for name, i in ((name, n + off) for name, off in K3_SPECIAL_OFFSETS.items())}
    special = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + RESERVED)}
    return TiktokenTokenizer(ranks, special, bos_token="[BOS]", eos_token="<|end_of_msg|>", pad_token="[PAD]")


def byte_tokenizer():
    """The tiny checkpoint's byte-level tokenizer with K3's special tokens named (ids 256..511)."""
    return k3_tokenizer(load_tokenizer(GOLDEN_DIR))


def xtml(tok, rendered: str) -> list[int]:
    table = k3_special_tokens(tok)
    pattern = "(" + "|".join(re.escape(name) for name in table) + "|¦)"
    ids: list[int] = []
    for piece in re.split(pattern, rendered):
        if piece in table:
            ids.append(table[piece])
        elif piece and piece != "¦":
            ids.extend(tok.encode(piece))
    return ids
