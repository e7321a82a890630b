"""Fixtures for the converter tests: CLI runs in a subprocess, and random releases of any size.

`write_release` writes a random checkpoint in the release format (language_model.* names, one
MXFP4 tensor pair per routed expert via `encode_mxfp4`, A_log zero-padded to head_dim, several
shards plus the index), so tests can use configs wider than the golden one without shipping data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from k3jax.checkpoint import CheckpointIndex, encode_mxfp4
from k3jax.config import K3Config
from k3jax.convert.plan import EXPERTS_PREFIX, abstract_items
from k3jax.model import K3Model

REPO = Path(__file__).resolve().parents[2]


def k3jax_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3jax", *map(str, args)]


def subprocess_env() -> dict[str, str]:
    """The repo importable (CI may not install it) and no accelerator: the converter is host-only."""
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(k3jax_command(*args), env=subprocess_env(), capture_output=True, text=True, timeout=300)


def _release_name(slot) -> str:
    if slot.layer is not None:
        return f"language_model.model.layers.{slot.layer}.{slot.target}"
    return "language_model." + (slot.target if slot.target.startswith("lm_head.") else f"model.{slot.target}")


def _random(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def write_release(root: Path, config: dict, *, seed: int = 0, num_shards: int = 2) -> Path:
    """Random weights for `config` (a release config.json dict), written as `root` in the HF layout."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    cfg = K3Config.from_hf(config)
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg))
    rng = np.random.default_rng(seed)
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(num_shards)]
    for n, slots in enumerate(abstract_items(abstract).values()):
        tensors = shards[n % num_shards]
        for slot, leaf in slots.items():
            name, dtype = _release_name(slot), np.dtype(leaf.dtype)
            if slot.target.startswith(EXPERTS_PREFIX):
                packed, scale = encode_mxfp4(_random(rng, leaf.shape, np.float32))
                base = name.removesuffix(slot.target) + EXPERTS_PREFIX
                for e in range(leaf.shape[0]):
                    projection = slot.target.removeprefix(EXPERTS_PREFIX)
                    tensors[f"{base}{e}.{projection}.weight_packed"] = packed[e]
                    tensors[f"{base}{e}.{projection}.weight_scale"] = scale[e]
            elif slot.target == "self_attn.A_log":
                tensors[name] = np.pad(rng.standard_normal(leaf.shape, np.float32), (0, cfg.kda_head_dim - leaf.shape[0]))
            else:
                tensors[name] = _random(rng, leaf.shape, dtype)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, str(root / file))
        weight_map.update({name: file for name in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def golden_config(golden_dir: Path, **text_overrides) -> dict:
    """The golden release config with text_config fields replaced."""
    config = json.loads((golden_dir / "config.json").read_text())
    config["text_config"].update(text_overrides)
    return config


def write_variant(root: Path, golden_dir: Path, tensors: dict[str, np.ndarray]) -> Path:
    """The golden config with `tensors` as a single-file checkpoint (an edited copy of the release)."""
    root.mkdir(parents=True)
    (root / "config.json").write_bytes((golden_dir / "config.json").read_bytes())
    save_file(tensors, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="session")
def golden_tensors(golden_dir) -> dict[str, np.ndarray]:
    index = CheckpointIndex.open(golden_dir)
    return {name: index.read(name) for name in index.names()}


@pytest.fixture(scope="session")
def converted_fp32(tmp_path_factory, golden_dir):
    """The golden release converted in float32 with --verify (experts kept MXFP4-packed, the default)."""
    from k3jax.convert import convert

    out = tmp_path_factory.mktemp("conv") / "fp32"
    convert(golden_dir, out, dtype="float32", verify=True, progress=False)
    return out
