"""Text <-> token ids: Kimi's tiktoken tokenizer from a checkpoint directory, or a byte-level fallback.

Kimi's release ships `tiktoken.model` (one "<base64 token bytes> <rank>" line per BPE token, rank =
id) and `tokenizer_config.json` (special tokens in `added_tokens_decoder`, the `bos_token` /
`eos_token` / `pad_token` names). As in Moonshot's `tokenization_kimi.py`: ids past the BPE ranks are 256 reserved
special tokens, named from `added_tokens_decoder` or `<|reserved_token_{id}|>`, and text is split
by Kimi's pre-tokenizer regex (Han runs kept apart) before BPE. Files are read locally, never
fetched, and nothing is unpickled; a malformed file is an error naming the file and the field or rank.

User text never produces control tokens: `encode` reads special-token strings as ordinary text unless
told `allow_special=True` (trusted text only). K3 has no Jinja chat template: chats are encoded by
`k3jax.chat.encode_messages`, which emits control tokens by id and encodes all text this way.

    tok = load_tokenizer("path/to/Kimi-K3")          # TiktokenTokenizer, or ByteTokenizer without tiktoken.model
    ids = tok.encode("user text")                     # "<|end_of_msg|>" in it stays text
    text = tok.decode(new_ids)

The fallback `ByteTokenizer` maps text to its UTF-8 bytes, byte value = id (0..255), and back
(invalid UTF-8 decodes with U+FFFD); ids >= 256 are special tokens: `bos_id` / `eos_id` / `pad_id`
(from the directory's config.json when there is one) and any given names; unnamed ones decode to
nothing. It needs no files, so the tiny test checkpoints (vocab 512, bos 256) can be driven by text.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import tiktoken

# Moonshot's pre-tokenizer split (tokenization_kimi.py), in tiktoken's regex dialect.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED_SPECIAL_TOKENS = 256
# tiktoken's regex runs in time superlinear in a piece's length: long inputs are cut first (as Kimi's does).
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one '<base64 bytes> <rank>' per line (blank lines ignored). Each token
    and each rank appears once and the ranks are 0..n-1: anything else would shift the special ids."""
    raw = Path(path).read_bytes()
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


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str = "text") -> str:
    """`text`, or a ValueError if it is not valid Unicode: a lone surrogate, which is how Python passes
    on bytes that were not UTF-8 (command-line arguments, files read with surrogateescape)."""
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected a string, got {type(text).__name__}")
    bad = _LONE_SURROGATE.search(text)
    if bad:
        code = ord(bad.group())
        detail = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise ValueError(f"{what} is not valid UTF-8: {detail} at character {bad.start()}")
    return text


def _read_json(path: Path) -> dict:
    """A JSON object from `path`; an error names the file (and where the JSON breaks)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_name(value: object, field: str, path: Path) -> str | None:
    """tokenizer_config's token entries are a string, {'content': <string>, ...} or null."""
    content = value.get("content") if isinstance(value, Mapping) else value
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{path}: {field}: expected a string or {{\"content\": <string>}}, got {value!r}")
    return content


class _TokenizerBase:
    """What both tokenizers share: checking ids before decoding them."""

    special_tokens: dict[str, int]

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        """ids as ints, each one this tokenizer can decode (else a ValueError naming the id)."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not self._decodable(i):
                raise ValueError(f"token id {i} is not in this tokenizer's vocabulary [0, {self.vocab_size})")
        return ids


class TiktokenTokenizer(_TokenizerBase):
    """Kimi's tokenizer: tiktoken BPE over `ranks` plus named special tokens."""

    def __init__(
        self, ranks: Mapping[bytes, int], special_tokens: Mapping[str, int], *, pat_str: str = KIMI_PAT_STR,
        bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None,
        unk_token: str | None = None, name: str = "kimi",
    ) -> None:
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=dict(special_tokens)
        )
        self.num_base_tokens = len(ranks)
        self.special_tokens = dict(special_tokens)
        self.unk_token = unk_token
        self._special_ids = set(self.special_tokens.values())
        self.bos_id, self.eos_id, self.pad_id = (self.special_tokens.get(t) for t in (bos_token, eos_token, pad_token))

    @classmethod
    def from_dir(cls, path: str | Path) -> "TiktokenTokenizer":
        path = Path(path)
        ranks = load_tiktoken_ranks(path / "tiktoken.model")
        config_path = path / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.exists() else {}
        decoder = config.get("added_tokens_decoder", {})
        if not isinstance(decoder, Mapping):
            raise ValueError(f"{config_path}: added_tokens_decoder: expected an object of id -> token, "
                             f"got {type(decoder).__name__}")
        added = {}
        for key, value in decoder.items():
            if not key.isdigit():
                raise ValueError(f"{config_path}: added_tokens_decoder: key {key!r} is not a token id")
            added[int(key)] = _token_name(value, f"added_tokens_decoder[{key}]", config_path)
        n = len(ranks)
        special = {added.get(i) or f"<|reserved_token_{i}|>": i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
        special.update({name: i for i, name in added.items() if i >= n and name})  # any beyond the reserved block
        names = {key: _token_name(config.get(key), key, config_path)
                 for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(ranks, special, name=path.name or "kimi", **names)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text -> ids. Special-token strings in `text` are ordinary text, or with allow_special=True
        (trusted text, e.g. a chat template's own output) their ids."""
        check_text(text)
        ids: list[int] = []
        for piece in _split_long(text):
            if allow_special:
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
            else:
                ids.extend(self.encoding.encode(piece, allowed_special=set(), disallowed_special=()))
        return ids

    def _decodable(self, i: int) -> bool:
        return 0 <= i < self.num_base_tokens or i in self._special_ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        ids = self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_base_tokens]
        return self.encoding.decode(ids, errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes (a streamed prefix may end inside a UTF-8 character)."""
        return self.encoding.decode_bytes(self._check_ids(ids))


def _split_long(text: str) -> list[str]:
    """Cut text into pieces of <= 400k chars, and inside a run of more than 25k whitespace (or
    non-whitespace) characters, as Kimi's tokenizer does; ordinary text stays one piece."""
    pieces = []
    for i in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk, start, run, space = text[i : i + _MAX_ENCODE_CHARS], 0, 0, None
        if len(chunk) <= _MAX_RUN_CHARS:
            pieces.append(chunk)
            continue
        for j, char in enumerate(chunk):
            run = run + 1 if char.isspace() == space else 1
            space = char.isspace()
            if run > _MAX_RUN_CHARS:
                pieces.append(chunk[start:j])
                start, run = j, 1
        pieces.append(chunk[start:])
    return pieces


class ByteTokenizer(_TokenizerBase):
    """Byte-level fallback: UTF-8 byte b <-> id b (0..255); ids >= 256 are special tokens (ids below
    `vocab_size` that have no name decode to nothing)."""

    def __init__(
        self, *, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None,
        special_tokens: Mapping[str, int] | None = None, vocab_size: int | None = None,
    ) -> None:
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.special_tokens = dict(special_tokens or {})
        if any(i < 256 for i in self.special_tokens.values()):
            raise ValueError("ByteTokenizer: ids 0..255 are the bytes; special tokens need ids >= 256")
        self._names = {i: name for name, i in self.special_tokens.items()}
        self._vocab_size = max([255, (vocab_size or 0) - 1, *(i for i in (bos_id, eos_id, pad_id) if i is not None),
                                *self.special_tokens.values()]) + 1
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)))
            if self.special_tokens else None
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text -> its UTF-8 bytes; with allow_special=True (trusted text) named special tokens -> their ids."""
        check_text(text)
        if not allow_special or self._special_re is None:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        last = 0
        for match in self._special_re.finditer(text):
            ids.extend(text[last : match.start()].encode("utf-8"))
            ids.append(self.special_tokens[match.group(0)])
            last = match.end()
        ids.extend(text[last:].encode("utf-8"))
        return ids

    def _decodable(self, i: int) -> bool:
        return 0 <= i < self._vocab_size

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()
        for i in self._check_ids(ids):
            if i < 256:
                pending.append(i)
                continue
            name = None if skip_special_tokens else self._names.get(i)
            if name is not None:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
                out.append(name)
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(i for i in self._check_ids(ids) if i < 256)


Tokenizer = TiktokenTokenizer | ByteTokenizer


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer (`tiktoken.model` in `path`), else the byte-level fallback with the
    bos / eos / pad ids and vocab_size of `path`/config.json when present."""
    if path is not None and (Path(path) / "tiktoken.model").exists():
        return TiktokenTokenizer.from_dir(path)
    ids: dict[str, int | None] = {}
    config_path = Path(path) / "config.json" if path is not None else None
    if config_path is not None and config_path.exists():
        config = _read_json(config_path)
        text = config.get("text_config", {})
        if not isinstance(text, dict):
            raise ValueError(f"{config_path}: text_config: expected an object, got {type(text).__name__}")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size"):
            value = config.get(key, text.get(key))
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{config_path}: {key}: expected a non-negative integer or null, got {value!r}")
            if key == "vocab_size":
                ids[key] = value
            else:  # ids below 256 are bytes here, so such a special token has no id in this tokenizer
                ids[key.removesuffix("_token_id") + "_id"] = value if value is not None and value >= 256 else None
    return ByteTokenizer(**ids)
