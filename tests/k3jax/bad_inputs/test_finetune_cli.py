"""Bad `k3jax finetune` command lines: one line on stderr, exit status 2, before the model loads (the loader
is a stand-in that fails the test) and before anything is written to --out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3jax import cli
from k3jax.training import run
from tests.conftest import GOLDEN_DIR


@pytest.fixture
def no_load(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the model loaded before the command line was checked")
    monkeypatch.setattr(run, "from_pretrained", forbidden)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "some text"}) + "\n")
    return path


def _main(argv: list[str]) -> int:
    """`k3jax.cli.main`'s exit status (argparse's usage errors exit through SystemExit)."""
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


CASES = [
    (["--steps", "0"], "--steps 0: expected an integer >= 1"),
    (["--steps", "x"], "argument --steps: expected an integer, got 'x'"),
    (["--lr", "0"], "--learning-rate 0.0: expected a finite number > 0"),
    (["--lr", "nan"], "--learning-rate nan: expected a finite number > 0"),
    (["--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
    (["--seq-len", "1"], "--seq-len 1: expected an integer >= 2"),
    (["--seed", "-1"], "--seed -1: expected an integer >= 0"),
    (["--seed", str(2**63)], "--seed 9223372036854775808: expected an integer in [0, 2**63 - 1]"),
    (["--lora-rank", "-2"], "--lora-rank -2: expected an integer >= 0"),
    (["--lora-alpha", "0"], "--lora-alpha 0.0: expected a finite number > 0"),
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
    (["--warmup-steps", "10", "--steps", "10"], "--warmup-steps 10: expected fewer than --steps 10"),
    (["--grad-accum-steps", "3", "--batch-size", "4"], "--batch-size 4: expected a multiple of --grad-accum-steps 3"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: expected a finite number >= 0"),
    (["--eval-data", "/nonexistent.jsonl"], "--eval-data /nonexistent.jsonl: no such file"),
    (["--mesh", "data=3"], "--mesh data=3: "),
    (["--lora-experts"], "--lora-experts: needs --lora-rank > 0"),
    (["--lora-rank", "2", "--lora-experts", "--mesh", "expert=8"],
     "--lora-experts: the adapted routed experts do not run expert-parallel; use a --mesh without an expert axis"),
]


@pytest.mark.parametrize("extra, message", CASES, ids=[c[1][:36] for c in CASES])
def test_bad_flags_exit_2_before_loading(no_load, data, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    code = _main(["finetune", "--model", str(GOLDEN_DIR), "--data", str(data), "--out", str(out), *extra])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err
    assert not out.exists()


def test_existing_out_without_resume_is_named(no_load, data, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert _main(["finetune", "--model", str(GOLDEN_DIR), "--data", str(data), "--out", str(out)]) == 2
    assert f"{out} already exists; pass --resume" in capsys.readouterr().err


def test_resume_without_a_run_is_named(no_load, data, tmp_path, capsys):
    out = tmp_path / "out"
    assert _main(["finetune", "--model", str(GOLDEN_DIR), "--data", str(data), "--out", str(out), "--resume"]) == 2
    assert f"--resume: {out} holds no run to resume" in capsys.readouterr().err


def test_bad_data_is_named_before_loading(no_load, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"input_ids": [1, 9999]}\n')
    code = _main(["finetune", "--model", str(GOLDEN_DIR), "--data", str(bad), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:2: input_ids: token id 9999 is outside the vocabulary [0, 512)" in err


def test_missing_model_config_exit_1(no_load, data, tmp_path, capsys):
    code = _main(["finetune", "--model", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "o")])
    assert code == 1 and "config.json" in capsys.readouterr().err


def test_lora_experts_must_be_a_bool(no_load, data, tmp_path):
    with pytest.raises(ValueError, match=r"^--lora-experts 'yes': expected a bool$"):
        run.finetune(GOLDEN_DIR, data, tmp_path / "out", lora_rank=2, lora_experts="yes")
    assert not (tmp_path / "out").exists()
