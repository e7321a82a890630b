"""Shared fixtures for tests/k3jax/nn: one tiny float32 model, built once per session (random init is the
slow part of these tests on CPU)."""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.nn.decoder import DecoderLayer

from tests.conftest import GOLDEN_DIR as GOLDEN  # noqa: E402


@pytest.fixture(scope="session")
def cfg() -> K3Config:
    """The golden tiny config in float32."""
    return K3Config.from_hf(GOLDEN, dtype="float32")


def flat_params(module) -> dict[tuple, np.ndarray]:
    state = nnx.state(module, nnx.Param)
    return {path: np.asarray(value) for path, value in jax.tree_util.tree_flatten_with_path(state)[0]}


@pytest.fixture(scope="session")
def tiny_built() -> tuple[K3Model, list[dict], K3Config]:
    """The golden-config model assembled from an explicitly built layer list (the same Rngs order as
    K3Model.init), plus a snapshot of every layer's parameters taken before the groups are stacked."""
    cfg = K3Config.from_hf(GOLDEN, dtype="float32")
    rngs = nnx.Rngs(0)
    layers = [DecoderLayer(cfg, mixer, ffn, dtype=jnp.float32, rngs=rngs) for mixer, ffn in cfg.layer_kinds]
    snapshots = [flat_params(layer) for layer in layers]
    return K3Model(cfg, layers, rngs=rngs), snapshots, cfg
