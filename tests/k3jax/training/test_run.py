"""`finetune` end to end on the golden tiny model: metrics per step, checkpoints, the plot, the export.

One full fine-tuning run of 4 steps (fp32, CPU) serves every test here. Data order seed 1 gives 4 batches of
one document per row, so the run compiles one train step (packed rows: test_packing.py, test_step.py)."""

from __future__ import annotations

import json

import pytest

import k3jax
from k3jax.training.run import finetune
from tests.conftest import GOLDEN_DIR
from tests.k3jax.training.finetune_helpers import BATCH, SEQ_LEN, data_loss, write_data

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    data = write_data(tmp / "data.jsonl")
    result = finetune(GOLDEN_DIR, data, tmp / "out", steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN,
                      learning_rate=3e-3, save_every=2, keep=1, seed=1, progress=False)
    return result, data


def test_metrics_one_line_per_step(run):
    result, _ = run
    lines = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1)) and lines == result.metrics
    for r in lines:
        assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "seconds"} <= r.keys()
        assert 0 < r["tokens"] <= BATCH * SEQ_LEN and r["tokens_per_s"] > 0
    assert lines[-1]["loss"] < lines[0]["loss"]  # the same few texts again and again: it learns them


def test_run_directory(run):
    result, data = run
    out = result.out
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recorded = json.loads((out / "run.json").read_text())
    assert recorded["options"]["steps"] == STEPS and recorded["data"] == str(data)
    # keep=1 latest plus the best by loss (the last one here too): only step 4 remains
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    assert result.final == out / "final" and not result.interrupted and result.steps == STEPS


def test_export_reloads_and_fits_the_data_better(run, golden_model_fp32):
    result, data = run
    tuned = k3jax.from_pretrained(result.final, dtype="float32")
    base, after = data_loss(golden_model_fp32, data), data_loss(tuned, data)
    # bf16 export of fp32 masters trained 4 steps at lr 3e-3 on this very data
    assert after < base - 0.5, (base, after)
