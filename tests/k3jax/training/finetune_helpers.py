"""Shared by the fine-tuning run tests: a small real-text data file and the loss of a model on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import k3jax
from k3jax.tokenizer import load_tokenizer
from k3jax.training.data import read_documents, split_documents
from tests.conftest import GOLDEN_DIR

TEXTS = [
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael. Some years ago, never mind how long precisely.",
    "In the beginning God created the heaven and the earth.",
    "Happy families are all alike; every unhappy family is unhappy in its own way.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife.",
    "All this happened, more or less.",
]
SEQ_LEN, BATCH = 32, 2


def write_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def data_loss(model: k3jax.K3Model, data: Path) -> float:
    """Mean next-token NLL of `model` over every target of `data` (each document split as training does),
    in one forward of all pieces right-padded to SEQ_LEN (causal: padding after a piece changes nothing in it)."""
    pieces = split_documents(read_documents(data, load_tokenizer(GOLDEN_DIR), vocab_size=512), SEQ_LEN)
    ids, targets, mask = (np.zeros((len(pieces), SEQ_LEN), dtype) for dtype in (np.int32, np.int32, np.float64))
    for row, piece in enumerate(pieces):
        n = len(piece["input_ids"])
        ids[row, :n], targets[row, :n], mask[row, :n] = piece["input_ids"], piece["targets"], piece["loss_mask"]
    logits = np.asarray(model(ids), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float(-(picked * mask).sum() / mask.sum())


