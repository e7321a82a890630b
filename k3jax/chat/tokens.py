"""K3's control tokens: their names, their ids, and a tokenizer that knows them.

K3 reserves the 256 ids after its BPE ranks for special tokens (163584.. in the release, whose
`tokenizer_config.json` names them). The chat format uses the ones below, at fixed offsets from the
start of that block; the tiny test checkpoints keep the same offsets from 256 (their reserved block
after the 256 byte ids), so one table serves both.

`<|open|>`, `<|close|>` and `<|sep|>` are not "special" in the release (they survive
`skip_special_tokens`); the others are.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3jax.tokenizer import ByteTokenizer, TiktokenTokenizer, Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
)

# Release `tokenizer_config.json` added_tokens_decoder: name -> offset from the first reserved id.
K3_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0, "[EOS]": 1, END_OF_MSG: 2, OPEN: 3, CLOSE: 4, SEP: 5, "[start_header_id]": 6,
    "[end_header_id]": 7, "[EOT]": 9, MEDIA_BEGIN: 18, MEDIA_CONTENT: 19, MEDIA_END: 20, MEDIA_PAD: 21,
    "<osagent_mode>": 65, "[UNK]": 254, "[PAD]": 255,
}
RESERVED = 256  # special-token slots after the BPE ranks


@dataclass(frozen=True)
class ControlIds:
    """The ids of the control tokens the chat format emits and reads."""

    open: int
    close: int
    sep: int
    end_of_msg: int
    media_begin: int
    media_content: int
    media_end: int
    media_pad: int


def _reserved_base(tokenizer: Tokenizer) -> int:
    """The first reserved special id: after the BPE ranks (tiktoken) or after the 256 bytes."""
    if isinstance(tokenizer, TiktokenTokenizer):
        return tokenizer.num_base_tokens
    if isinstance(tokenizer, ByteTokenizer):
        return 256
    raise TypeError(f"expected a k3jax tokenizer (TiktokenTokenizer or ByteTokenizer), got {type(tokenizer).__name__}")


def k3_special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """K3's special-token names -> ids for this tokenizer; an error if the tokenizer's vocabulary has no
    room for them or names one of those ids differently (e.g. a K2 tokenizer: `<|im_end|>` where K3
    has `<|end_of_msg|>`)."""
    base = _reserved_base(tokenizer)
    if tokenizer.vocab_size < base + RESERVED:
        raise ValueError(f"the tokenizer's vocabulary has {tokenizer.vocab_size} ids; K3's chat format needs the "
                         f"{RESERVED} reserved special ids from {base} (vocab_size >= {base + RESERVED})")
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    table = {}
    for name, offset in K3_SPECIAL_OFFSETS.items():
        i = base + offset
        other = names.get(i)
        if other is not None and other != name and other != f"<|reserved_token_{i}|>":
            raise ValueError(f"the tokenizer names special id {i} {other!r}, but K3's is {name!r} "
                             "(a tokenizer of another model?)")
        table[name] = i
    for attr, name in (("bos_id", "[BOS]"), ("eos_id", END_OF_MSG)):
        value = getattr(tokenizer, attr)
        if value is not None and value != table[name]:
            raise ValueError(f"the tokenizer's {attr}={value}, but K3's {name} is id {table[name]}")
    return table


def control_ids(tokenizer: Tokenizer) -> ControlIds:
    """The chat control ids of this tokenizer (checked as in `k3_special_tokens`)."""
    table = k3_special_tokens(tokenizer)
    return ControlIds(
        open=table[OPEN], close=table[CLOSE], sep=table[SEP], end_of_msg=table[END_OF_MSG],
        media_begin=table[MEDIA_BEGIN], media_content=table[MEDIA_CONTENT], media_end=table[MEDIA_END],
        media_pad=table[MEDIA_PAD],
    )


def k3_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with K3's special tokens named, so that they decode to their names.

    A release tokenizer already names them and is returned as is; the byte-level fallback of the tiny
    checkpoints (which ship no tokenizer files) gets a copy with the names on its reserved block."""
    table = k3_special_tokens(tokenizer)
    if isinstance(tokenizer, TiktokenTokenizer):
        missing = [name for name, i in table.items() if tokenizer.special_tokens.get(name) != i]
        if missing:
            raise ValueError(f"the tokenizer does not name K3's special tokens {missing} (tokenizer_config.json "
                             "added_tokens_decoder)")
        return tokenizer
    return ByteTokenizer(
        bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        special_tokens={**tokenizer.special_tokens, **table}, vocab_size=tokenizer.vocab_size,
    )
