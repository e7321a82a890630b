"""Fine-tuning data: JSONL records -> token documents -> shuffled, packed [B, T] rows with a resumable position.

Each line of the file is one JSON object of one of three kinds:

    {"messages": [{"role": "user", "content": "..."}, ...]}    chat, K3's chat encoding; loss on assistant turns
    {"text": "..."}                                            plain text; loss on every token
    {"input_ids": [1, 2, ...], "loss_mask": [0, 1, ...]}       pre-tokenised; loss_mask optional (all ones)

A document is a token sequence with one mask value per token (1: the token is a loss target, predicted
from the tokens before it; the first token is never a target). Text gets the tokenizer's bos token first
and eos token last when it has them. Every record is checked as it is read; an error names the file,
the line and the field.

Documents are cut into pieces of at most T (input, target) pairs: a document of n tokens has n - 1 pairs,
the piece k holds pairs [kT, (k+1)T), so the next piece's first input is the previous piece's last target.
Every piece is its own segment (nothing of the earlier piece is visible to it) and pieces shuffle
independently; a piece with no loss target is dropped.

Shuffling, epochs and packing are grain's (`MapDataset.shuffle(seed).repeat()` reshuffles every epoch,
`FirstFitPackIterDataset` packs pieces into rows with 1-based segment ids, 0 = padding): its iterator
state is a small JSON-able dict, the exact data position a checkpoint stores and `--resume` restores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np
from grain import experimental as grain_experimental

from k3jax.chat import encode_for_training, k3_tokenizer, messages_from_dicts
from k3jax.tokenizer import Tokenizer

# `(tokenizer, messages) -> (ids, loss_mask)`: K3's chat encoding of one conversation for training.
ChatEncoder = Callable[[Tokenizer, Sequence[Mapping[str, Any]]], tuple[Sequence[int], Sequence[float]]]
FIELDS = ("input_ids", "targets", "loss_mask")


class DataError(ValueError):
    """A record that is not one of the accepted kinds; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One record as tokens: `ids` int32 [n], `mask` float32 [n] (1 where the token is a loss target)."""

    ids: np.ndarray
    mask: np.ndarray


def k3_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int]]:
    """K3's chat encoding of OpenAI-style message dicts, loss on the assistant turns (`k3jax.chat`)."""
    return encode_for_training(k3_tokenizer(tokenizer), messages_from_dicts(messages))


def _int_list(value: object, where: str, field: str, vocab_size: int) -> np.ndarray:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise DataError(f"{where}: {field}: expected a list of integer token ids")
    ids = np.asarray(value, np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise DataError(f"{where}: {field}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def _mask_list(value: object, where: str, field: str, length: int) -> np.ndarray:
    if not isinstance(value, list) or not all(v in (0, 1) for v in value):  # True/False compare equal to 1/0
        raise DataError(f"{where}: {field}: expected a list of 0/1 (or true/false) values")
    if len(value) != length:
        raise DataError(f"{where}: {field}: has {len(value)} values, input_ids has {length}; expected one per token")
    return np.asarray(value, np.float32)


def _record_document(record: object, where: str, tokenizer: Tokenizer, vocab_size: int,
                     encode_chat: ChatEncoder) -> Document:
    """One parsed JSON line -> a Document, or a DataError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kinds = [k for k in ("messages", "text", "input_ids") if k in record]
    if len(kinds) != 1:
        raise DataError(f"{where}: expected exactly one of the fields messages, text, input_ids; got "
                        f"{sorted(record) or 'none'}")
    kind = kinds[0]
    allowed = {"input_ids", "loss_mask"} if kind == "input_ids" else {kind}
    extra = sorted(set(record) - allowed)
    if extra:
        raise DataError(f"{where}: unexpected field {extra[0]!r} in a {kind!r} record (expected {sorted(allowed)})")
    if kind == "text":
        text = record["text"]
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: text: expected a non-empty string")
        try:
            body = tokenizer.encode(text)
        except ValueError as err:
            raise DataError(f"{where}: text: {err}") from None
        ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + body
        ids += [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        doc = Document(_int_list(ids, where, "text", vocab_size), np.ones(len(ids), np.float32))
    elif kind == "input_ids":
        ids = _int_list(record["input_ids"], where, "input_ids", vocab_size)
        mask = (_mask_list(record["loss_mask"], where, "loss_mask", len(ids)) if "loss_mask" in record
                else np.ones(len(ids), np.float32))
        doc = Document(ids, mask)
    else:
        if not isinstance(record["messages"], list) or not record["messages"]:
            raise DataError(f"{where}: messages: expected a non-empty list of message objects")
        try:
            ids, mask = encode_chat(tokenizer, record["messages"])
        except (ValueError, TypeError, KeyError) as err:
            raise DataError(f"{where}: messages: {err}") from None
        doc = Document(_int_list(list(map(int, ids)), where, "messages", vocab_size), np.asarray(mask, np.float32))
    if len(doc.ids) < 2:
        raise DataError(f"{where}: {kind}: {len(doc.ids)} token(s); a document needs at least 2 (a target and "
                        "a token before it)")
    if not doc.mask[1:].any():
        raise DataError(f"{where}: {kind}: no token after the first carries loss (nothing to learn from)")
    return doc


def read_documents(path: str | Path, tokenizer: Tokenizer, *, vocab_size: int,
                   encode_chat: ChatEncoder = k3_chat) -> list[Document]:
    """Every record of the JSONL file `path`, checked and tokenised (blank lines are skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    docs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        docs.append(_record_document(record, where, tokenizer, vocab_size, encode_chat))
    if not docs:
        raise DataError(f"{path}: no records (expected one JSON object per line)")
    return docs


def split_documents(docs: Sequence[Document], seq_len: int) -> list[dict[str, np.ndarray]]:
    """Documents -> pieces of at most `seq_len` (input, target) pairs (see the module docstring)."""
    pieces = []
    for doc in docs:
        pairs = len(doc.ids) - 1
        for k in range(0, pairs, seq_len):
            end = min(k + seq_len, pairs)
            piece = {"input_ids": doc.ids[k:end], "targets": doc.ids[k + 1:end + 1], "loss_mask": doc.mask[k + 1:end + 1]}
            if piece["loss_mask"].any():
                pieces.append(piece)
    return pieces


def fingerprint(path: str | Path) -> str:
    """sha256 of the data file: a resumed run checks it is reading the same data."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class PackedBatches:
    """An endless stream of packed batches: dicts of numpy input_ids / targets / segment_ids (int32 [B, T])
    and loss_mask (float32 [B, T]); `position()` / `seek()` save and restore the exact place in it."""

    def __init__(self, pieces: Sequence[dict[str, np.ndarray]], *, batch_size: int, seq_len: int, seed: int) -> None:
        if not pieces:
            raise DataError("no document has a loss target")
        self.batch_size, self.seq_len = batch_size, seq_len
        source = grain.MapDataset.source(list(pieces)).shuffle(seed=seed % 2**32).repeat(None)
        packed = grain_experimental.FirstFitPackIterDataset(
            source.to_iter_dataset(), length_struct={f: seq_len for f in FIELDS}, num_packing_bins=batch_size,
            seed=seed % 2**32)
        self._dataset = packed.batch(batch_size, drop_remainder=True)
        self._iter = iter(self._dataset)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = next(self._iter)
        return {"input_ids": rows["input_ids"].astype(np.int32), "targets": rows["targets"].astype(np.int32),
                "loss_mask": rows["loss_mask"].astype(np.float32),
                "segment_ids": rows["input_ids_segment_ids"].astype(np.int32)}

    def position(self) -> dict[str, Any]:
        """The iterator state (JSON-able): the next batch after `seek(position)` is the next batch now."""
        return self._iter.get_state()

    def seek(self, position: dict[str, Any]) -> None:
        self._iter = iter(self._dataset)
        self._iter.set_state(position)
