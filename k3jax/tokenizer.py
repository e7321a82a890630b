"""Text <-> token ids: Kimi's tiktoken tokenizer from a checkpoint directory, or a byte-level fallback.

Kimi's release ships `tiktoken.model` (one "<base64 token bytes> <rank>" line per BPE token, rank =
id) and `tokenizer_config.json` (special tokens in `added_tokens_decoder`, the `bos_token` /
`eos_token` / `pad_token` names, and a Jinja `chat_template`, or a `chat_template.jinja` file
beside it). As in Moonshot's `tokenization_kimi.py`: ids past the BPE ranks are 256 reserved
special tokens, named from `added_tokens_decoder` or `<|reserved_token_{id}|>`, and text is split
by Kimi's pre-tokenizer regex (Han runs kept apart) before BPE. Files are read locally, never
fetched, and nothing is unpickled.

    tok = load_tokenizer("path/to/Kimi-K3")          # TiktokenTokenizer, or ByteTokenizer without tiktoken.model
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import tiktoken
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    """Parse a tiktoken BPE file: one '<base64 bytes> <rank>' per line (blank lines ignored)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: expected '<base64 token> <rank>', got {line!r}") from err
    return ranks


def _token_name(value: object) -> str | None:
    """tokenizer_config's token entries are either a string or {'content': ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


class _ChatTemplateMixin:
    chat_template: str | None
    special_token_names: dict[str, str | None]

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:  # pragma: no cover - interface
        raise NotImplementedError

    def render_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat template applied to messages (HF conventions: trim_blocks, lstrip_blocks, sandboxed)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template')")

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        variables = {**self.special_token_names, **kwargs}
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """Render the chat and encode it, special tokens in the rendered text parsed as such."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs))


class TiktokenTokenizer(_ChatTemplateMixin):
    """Kimi's tokenizer: tiktoken BPE over `ranks` plus named special tokens."""

    def __init__(
        self, ranks: Mapping[bytes, int], special_tokens: Mapping[str, int], *, pat_str: str = KIMI_PAT_STR,
        bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None,
        unk_token: str | None = None, chat_template: str | None = None, name: str = "kimi",
    ) -> None:
        self.encoding = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=dict(special_tokens)
        )
        self.num_base_tokens = len(ranks)
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.special_token_names = {
            "bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token,
        }
        self.bos_id, self.eos_id, self.pad_id = (self.special_tokens.get(t) for t in (bos_token, eos_token, pad_token))

    @classmethod
    def from_dir(cls, path: str | Path) -> "TiktokenTokenizer":
        path = Path(path)
        ranks = load_tiktoken_ranks(path / "tiktoken.model")
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        added = {int(i): _token_name(v) for i, v in config.get("added_tokens_decoder", {}).items()}
        n = len(ranks)
        special = {added.get(i) or f"<|reserved_token_{i}|>": i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
        special.update({name: i for i, name in added.items() if i >= n and name})  # any beyond the reserved block
        template = config.get("chat_template")
        if isinstance(template, list):  # HF's named-template form: [{"name": "default", "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        names = {key: _token_name(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(ranks, special, chat_template=template, name=path.name or "kimi", **names)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Text -> ids. Special-token strings in `text` become their ids, or with allow_special=False
        are encoded as ordinary text."""
        ids: list[int] = []
        for piece in _split_long(text):
            if allow_special:
                ids.extend(self.encoding.encode(piece, allowed_special="all"))
            else:
                ids.extend(self.encoding.encode_ordinary(piece))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_base_tokens]
        return self.encoding.decode(ids, errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes (a streamed prefix may end inside a UTF-8 character)."""
        return self.encoding.decode_bytes([int(i) for i in ids])


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


class ByteTokenizer(_ChatTemplateMixin):
    """Byte-level fallback: UTF-8 byte b <-> id b (0..255); ids >= 256 are special tokens."""

    def __init__(
        self, *, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None,
        special_tokens: Mapping[str, int] | None = None, chat_template: str | None = None,
    ) -> None:
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.special_tokens = dict(special_tokens or {})
        if any(i < 256 for i in self.special_tokens.values()):
            raise ValueError("ByteTokenizer: ids 0..255 are the bytes; special tokens need ids >= 256")
        self._names = {i: name for name, i in self.special_tokens.items()}
        self.chat_template = chat_template
        self.special_token_names = {
            "bos_token": self._names.get(bos_id), "eos_token": self._names.get(eos_id),
            "pad_token": self._names.get(pad_id), "unk_token": None,
        }
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)))
            if self.special_tokens else None
        )

    @property
    def vocab_size(self) -> int:
        return max([255, *(i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None),
                    *self.special_tokens.values()]) + 1

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
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

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
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
        return bytes(i for i in (int(i) for i in ids) if 0 <= i < 256)


Tokenizer = TiktokenTokenizer | ByteTokenizer


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer (`tiktoken.model` in `path`), else the byte-level fallback with the
    bos / eos / pad ids of `path`/config.json when present."""
    if path is not None and (Path(path) / "tiktoken.model").exists():
        return TiktokenTokenizer.from_dir(path)
    ids: dict[str, int | None] = {}
    config_path = Path(path) / "config.json" if path is not None else None
    if config_path is not None and config_path.exists():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        text = config.get("text_config", {})
        for key in ("bos", "eos", "pad"):
            value = config.get(f"{key}_token_id", text.get(f"{key}_token_id"))
            ids[f"{key}_id"] = value if isinstance(value, int) and value >= 256 else None
    return ByteTokenizer(**ids)
