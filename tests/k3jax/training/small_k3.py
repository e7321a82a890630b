"""A 5-layer K3 for training tests: the golden tiny config cut to [KDA+dense] then two scanned groups of
[KDA+MoE, MLA+MoE], so head, scanned (stacked) and both mixer kinds are exercised with few compiles."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import K3Config
from k3jax.kernels import Kernels
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


@functools.cache
def _initial(dtype: str, seed: int, kernels: Kernels) -> tuple[nnx.GraphDef, nnx.State]:
    """`K3Model.init` once per process and arguments, its weights kept on the host. The init runs eagerly,
    one small compiled program per op and shape (~8 s on 2 cores), and tests/conftest.py drops compiled
    programs after every module, so each module would otherwise pay it again."""
    graphdef, state = nnx.split(K3Model.init(small_config(dtype), seed=seed, kernels=kernels))
    return graphdef, jax.tree.map(np.array, state)


def small_model(dtype: str = "float32", seed: int = 0, kernels=None) -> K3Model:
    """A fresh model, weights bit for bit `K3Model.init`'s, in buffers of its own (a test may train it or
    donate them)."""
    graphdef, state = _initial(dtype, seed, Kernels.of(kernels))
    # np.array copies first: on CPU device_put may alias the host buffer, which a donating step would overwrite.
    return nnx.merge(graphdef, jax.tree.map(lambda x: jax.device_put(np.array(x)), state))


def random_batch(rows: int, length: int, *, seed: int = 0, vocab: int = 512, segments: np.ndarray | None = None) -> Batch:
    """Random tokens, next-token targets, loss on every position but the last of each row."""
    ids = np.random.default_rng(seed).integers(0, vocab, (rows, length + 1)).astype(np.int32)
    mask = np.ones((rows, length), np.float32)
    seg = np.ones((rows, length), np.int32) if segments is None else segments
    return Batch(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.asarray(mask), jnp.asarray(seg))
