"""`k3jax finetune` as a user runs it, in subprocesses: a run killed with SIGKILL and one stopped with Ctrl-C
(SIGINT) both continue with --resume to exactly the loss curve of an uninterrupted run (CPU: identical
numbers), and the exported model is where the summary says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import GOLDEN_DIR
from tests.k3jax.training.finetune_helpers import write_data

ROOT = Path(__file__).resolve().parents[3]
STEPS = 7
# Data order: with this seed every batch holds one document per row, so each run traces and compiles one
# train step (packed rows are `Trainer.step`'s own tests' business: tests/k3jax/training/test_packing.py).
SEED = 2


def _command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "k3jax", "finetune", "--model", str(GOLDEN_DIR), "--data", str(data),
            "--out", str(out), "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32", "--lr", "3e-3",
            "--warmup-steps", "2", "--save-every", "3", "--seed", str(SEED), "--no-progress", *extra]


def _start(cmd: list[str], compile_cache: Path | None = None) -> subprocess.Popen:
    """`cmd` in a subprocess; runs given the same `compile_cache` compile the training step only once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    if compile_cache is not None:
        env |= {"JAX_COMPILATION_CACHE_DIR": str(compile_cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop_after(proc: subprocess.Popen, metrics: Path, lines: int, sig: int) -> None:
    """Send `sig` once `metrics` has `lines` lines (the run is then mid-way between checkpoints)."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= lines:
            proc.send_signal(sig)
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or stalled before step {lines}: {proc.communicate()}")


def _losses(out: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_sigkill_and_ctrl_c_resume_the_exact_curve(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    cache = tmp_path / "compiled"
    reference = _start(_command(data, tmp_path / "reference"), cache)
    _, ref_err = reference.communicate(timeout=900)
    assert reference.returncode == 0, ref_err
    out = tmp_path / "run"
    killed = _start(_command(data, out), cache)
    _stop_after(killed, out / "metrics.jsonl", 4, signal.SIGKILL)  # after step 4; last checkpoint: step 3
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL

    interrupted = _start(_command(data, out, "--resume"), cache)
    _stop_after(interrupted, out / "metrics.jsonl", 5, signal.SIGINT)  # Ctrl-C after step 5
    _, err = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 130, err
    assert "checkpoint saved" in err and "--resume" in err
    assert (out / "checkpoints" / "5").is_dir() or (out / "checkpoints" / "6").is_dir()

    finished = _start(_command(data, out, "--resume"), cache)
    stdout, err = finished.communicate(timeout=900)
    assert finished.returncode == 0, err
    assert _losses(out) == _losses(tmp_path / "reference")  # every step, bit for bit
    assert [s for s, _, _ in _losses(out)] == list(range(1, STEPS + 1))
    assert f"model in {out / 'final'}" in stdout and (out / "final" / "config.json").is_file()


def test_out_exists_is_an_error_naming_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    proc = _start(_command(write_data(tmp_path / "data.jsonl"), out))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.strip() == (f"error: {out} already exists; pass --resume to continue the "
                                                    "run in it, or choose another --out")
