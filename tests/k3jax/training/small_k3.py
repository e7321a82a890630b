"""A 5-layer K3 for training tests: the golden tiny config cut to [KDA+dense] then two scanned groups of
[KDA+MoE, MLA+MoE], so head, scanned (stacked) and both mixer kinds are exercised with few compiles."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.training import Batch
from tests.conftest import GOLDEN_DIR


def small_config(dtype: str = "float32") -> K3Config:
    data = json.loads((GOLDEN_DIR / "config.json").read_text())
    text = data["text_config"]
    text["num_hidden_layers"] = 5
    text["linear_attn_config"]["kda_layers"] = [1, 2, 4]
    text["linear_attn_config"]["full_attn_layers"] = [3, 5]
    return K3Config.from_hf(data, dtype=dtype)


def small_model(dtype: str = "float32", seed: int = 0, kernels=None) -> K3Model:
    return K3Model.init(small_config(dtype), seed=seed, kernels=kernels)


def random_batch(rows: int, length: int, *, seed: int = 0, vocab: int = 512, segments: np.ndarray | None = None) -> Batch:
    """Random tokens, next-token targets, loss on every position but the last of each row."""
    ids = np.random.default_rng(seed).integers(0, vocab, (rows, length + 1)).astype(np.int32)
    mask = np.ones((rows, length), np.float32)
    seg = np.ones((rows, length), np.int32) if segments is None else segments
    return Batch(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.asarray(mask), jnp.asarray(seg))
