"""Fine-tuning data: records -> documents, the split of long documents, packing, shuffling and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k3jax.tokenizer import ByteTokenizer
from k3jax.training.data import PackedBatches, read_documents, split_documents

TOKENIZER = ByteTokenizer(bos_id=256, eos_id=258, vocab_size=512)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_and_pretokenised_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}, {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]},
                                              {"input_ids": [9, 8]}])
    docs = read_documents(path, TOKENIZER, vocab_size=512)
    assert docs[0].ids.tolist() == [256, ord("h"), ord("i"), 258]  # bos, the bytes, eos
    assert docs[0].mask.tolist() == [1, 1, 1, 1]
    assert docs[1].ids.tolist() == [5, 6, 7] and docs[1].mask.tolist() == [0, 0, 1]
    assert docs[2].mask.tolist() == [1, 1]  # loss_mask omitted: every token


def test_chat_records_use_the_chat_encoder(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    seen = []

    def encode(tokenizer, messages):
        seen.append(messages)
        return [1, 2, 3], [0, 1, 1]

    docs = read_documents(path, TOKENIZER, vocab_size=512, encode_chat=encode)
    assert seen == [[{"role": "user", "content": "a"}]]
    assert docs[0].ids.tolist() == [1, 2, 3] and docs[0].mask.tolist() == [0, 1, 1]


def test_chat_records_default_to_k3s_encoding(tmp_path):
    messages = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    docs = read_documents(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}]), TOKENIZER, vocab_size=512)
    ids, mask = docs[0].ids, docs[0].mask
    trained = bytes(int(i) for i, m in zip(ids, mask) if m and i < 256)
    untrained = bytes(int(i) for i, m in zip(ids, mask) if not m and i < 256)
    assert b"pong" in trained and b"ping" not in trained and b"ping" in untrained
    assert mask[-1] == 1 and ids[-1] == 258  # the closing <|end_of_msg|> is learned


def test_long_documents_split_into_pieces_of_seq_len_pairs(tmp_path):
    records = [{"input_ids": list(range(10))}, {"input_ids": list(range(20, 30)), "loss_mask": [1] * 9 + [0]}]
    pieces = split_documents(read_documents(write_jsonl(tmp_path / "d.jsonl", records), TOKENIZER, vocab_size=512), 4)
    # 9 pairs: [0..3]->[1..4], [4..7]->[5..8], [8]->[9]; the next piece starts at the previous piece's last target
    assert [p["input_ids"].tolist() for p in pieces[:3]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert [p["targets"].tolist() for p in pieces[:3]] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    # the second document's last piece (input 28, target 29) carries no loss and is dropped
    assert [p["input_ids"].tolist() for p in pieces[3:]] == [[20, 21, 22, 23], [24, 25, 26, 27]]
    assert pieces[4]["loss_mask"].tolist() == [1, 1, 1, 1]


def _corpus(tmp_path: Path, n: int = 23) -> list[dict]:
    rng = np.random.default_rng(0)
    records = [{"input_ids": rng.integers(0, 256, rng.integers(2, 12)).tolist()} for _ in range(n)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    return split_documents(read_documents(path, TOKENIZER, vocab_size=512), 8)


def _segments(batch: dict) -> list[tuple]:
    """Each packed segment as (inputs, targets, mask) tuples, read back from the rows by segment id."""
    found = []
    for row in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            at = seg == s
            assert np.flatnonzero(at).tolist() == list(range(np.flatnonzero(at)[0], np.flatnonzero(at)[-1] + 1))
            found.append(tuple(tuple(batch[f][row][at].tolist()) for f in ("input_ids", "targets", "loss_mask")))
        assert not batch["loss_mask"][row][seg == 0].any()  # padding carries no loss
    return found


def test_packing_is_exact_and_each_epoch_a_shuffle(tmp_path):
    pieces = _corpus(tmp_path)
    expected = sorted(tuple(tuple(p[f].tolist()) for f in ("input_ids", "targets", "loss_mask")) for p in pieces)
    stream = PackedBatches(pieces, batch_size=2, seq_len=8, seed=3)
    batch = next(stream)
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "input_ids": ((2, 8), "int32"), "targets": ((2, 8), "int32"), "segment_ids": ((2, 8), "int32"),
        "loss_mask": ((2, 8), "float32")}
    seen = _segments(batch)
    while len(seen) < 2 * len(pieces):
        seen += _segments(next(stream))
    # each piece appears exactly once per epoch (pieces of one epoch may be packed beside the next's)
    first, second = seen[: len(pieces)], seen[len(pieces): 2 * len(pieces)]
    assert sorted(first + second) == sorted(expected * 2)
    assert first != second  # reshuffled
    other = PackedBatches(pieces, batch_size=2, seq_len=8, seed=4)
    assert _segments(next(other)) != _segments(next(PackedBatches(pieces, batch_size=2, seq_len=8, seed=3)))


def test_position_resumes_the_same_batches(tmp_path):
    pieces = _corpus(tmp_path)
    stream = PackedBatches(pieces, batch_size=3, seq_len=8, seed=0)
    for _ in range(5):
        next(stream)
    position = json.loads(json.dumps(stream.position()))  # what a checkpoint stores
    expected = [next(stream) for _ in range(6)]
    resumed = PackedBatches(pieces, batch_size=3, seq_len=8, seed=0)
    resumed.seek(position)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
