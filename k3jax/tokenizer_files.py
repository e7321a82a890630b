"""Reading a checkpoint's tokenizer files (local or at a URL): each one's bytes checked before they are
parsed, and every error naming the file and what is wrong at which line, rank or byte."""

from __future__ import annotations

import base64
import json
import os

from k3jax.load.paths import CheckpointPath, checkpoint_path

# What `load_tokenizer` reads from a checkpoint directory (`k3jax convert` copies these, with the
# release's other text files, so a converted directory tokenizes on its own).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def read_text_file(path: CheckpointPath) -> str:
    """The UTF-8 text of a tokenizer file; a file that is not UTF-8 is a ValueError naming it and the
    first bad byte (a Latin-1 or UTF-16 config would otherwise fail deep inside a parser)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text: byte {raw[err.start]:#04x} at offset {err.start} "
                         f"({err.reason})") from None


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one '<base64 bytes> <rank>' per line (blank lines ignored). Each token
    and each rank appears once and the ranks are 0..n-1: anything else would shift the special ids."""
    path = checkpoint_path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: byte {raw[err.start]:#04x} at offset {err.start} is not ASCII; expected "
                         "'<base64 token> <rank>' lines") from None
    ranks: dict[bytes, int] = {}
    lines: dict[int, int] = {}  # rank -> line number
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank_text = line.split()
            token_bytes, rank = base64.b64decode(token, validate=True), int(rank_text)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: expected '<base64 token> <rank>', got {line!r}") from err
        if rank < 0:
            raise ValueError(f"{path}:{number}: rank {rank} is negative")
        if rank in lines:
            raise ValueError(f"{path}:{number}: rank {rank} appears again (first on line {lines[rank]})")
        if token_bytes in ranks:
            raise ValueError(f"{path}:{number}: token {token_bytes!r} appears again, with rank {rank} "
                             f"(first with rank {ranks[token_bytes]})")
        ranks[token_bytes], lines[rank] = rank, number
    if len(lines) and max(lines) != len(lines) - 1:
        missing = next(r for r in range(len(lines)) if r not in lines)
        raise ValueError(f"{path}: ranks must be 0..{len(lines) - 1} with none missing; rank {missing} is missing "
                         f"(the largest is {max(lines)})")
    return ranks


def read_json(path: CheckpointPath) -> dict:
    """A JSON object from `path`; an error names the file (and where the text or the JSON breaks)."""
    try:
        value = json.loads(read_text_file(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
