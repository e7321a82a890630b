"""The `k3jax` command: demo end to end, generate (ids and text, sharded), and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[2]


def k3jax(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "k3jax", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_demo_writes_converts_restores_sharded_and_generates():
    run = k3jax("demo", "--max-new-tokens", "6")
    assert run.returncode == 0, run.stderr
    assert "restored over mesh data=2,expert=2,tensor=2 on 8 cpu devices" in run.stdout
    assert "tokens/s" in run.stdout


def test_generate_ids_is_the_reference_greedy_continuation(golden_reference):
    reference = golden_reference("generate_fp32")
    prompt = ",".join(map(str, reference["prompt_ids"][0]))
    run = k3jax("generate", "--model", str(GOLDEN_DIR), "--ids", prompt, "--max-new-tokens", "12",
                "--dtype", "float32")
    assert run.returncode == 0, run.stderr
    ids_line = next(line for line in run.stdout.splitlines() if line.startswith("ids: "))
    assert np.array_equal(eval(ids_line.removeprefix("ids: ")), reference["new_ids"][0])
    assert "tokens/s" in run.stderr


def test_generate_text_prompt_on_a_mesh():
    run = k3jax("generate", "--model", str(GOLDEN_DIR), "--prompt", "hello", "--mesh", "expert=8",
                "--max-new-tokens", "4")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("hello") and "mesh expert=8" in run.stderr


def test_generate_errors_are_one_line_and_nonzero(tmp_path):
    run = k3jax("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert run.returncode == 1 and run.stderr.startswith("error:") and "config.json" in run.stderr
    run = k3jax("generate", "--model", str(GOLDEN_DIR), "--ids", "1,99999")
    assert run.returncode == 2 and "outside the vocabulary" in run.stderr
