"""Fixtures for the converter tests: CLI runs in a subprocess, and random releases of any size
(`write_release`, from k3jax.checkpoint.release_writer), so tests can use configs wider than the
golden one without shipping data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3jax.checkpoint import CheckpointIndex
from k3jax.convert import convert

REPO = Path(__file__).resolve().parents[3]


def k3jax_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3jax", *map(str, args)]


def subprocess_env() -> dict[str, str]:
    """The repo importable (CI may not install it) and no accelerator: the converter is host-only."""
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(k3jax_command(*args), env=subprocess_env(), capture_output=True, text=True, timeout=300)


def golden_config(golden_dir: Path, **text_overrides) -> dict:
    """The golden release config with text_config fields replaced (the vision projector follows the text width)."""
    config = json.loads((golden_dir / "config.json").read_text())
    config["text_config"].update(text_overrides)
    config["vision_config"]["text_hidden_size"] = config["text_config"]["hidden_size"]
    return config


@pytest.fixture(scope="session")
def golden_tensors(golden_dir) -> dict[str, np.ndarray]:
    index = CheckpointIndex.open(golden_dir)
    return {name: index.read(name) for name in index.names()}


@pytest.fixture(scope="session")
def converted_fp32(tmp_path_factory, golden_dir):
    """The golden release converted in float32 with --verify (experts kept MXFP4-packed, the default)."""
    out = tmp_path_factory.mktemp("conv") / "fp32"
    convert(golden_dir, out, dtype="float32", verify=True, progress=False)
    return out
