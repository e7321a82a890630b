"""The `k3jax` command: demo end to end, generate (ids and text, sharded, stop tokens), and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from k3jax.cli import main
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


def test_generate_stop_ends_the_reference_continuation(golden_reference, capsys):
    """In-process, the real model with its layers unrolled: --stop TOKEN ends the greedy continuation at
    its first occurrence."""
    reference = golden_reference("generate_fp32")
    new_ids = [int(i) for i in reference["new_ids"][0]]
    stop = new_ids[3]
    prompt = ",".join(map(str, reference["prompt_ids"][0]))
    assert main(["generate", "--model", str(GOLDEN_DIR), "--ids", prompt, "--max-new-tokens", "12",
                 "--dtype", "float32", "--layers", "unrolled", "--stop", str(stop)]) == 0
    ids_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ids: "))
    assert eval(ids_line.removeprefix("ids: ")) == new_ids[: new_ids.index(stop) + 1]


def test_generate_errors_are_one_line_and_nonzero(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "config.json" in err
    assert main(["generate", "--model", str(GOLDEN_DIR), "--ids", "1,99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
