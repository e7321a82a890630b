"""Smoke run of benchmarks/vision_tower.py on CPU (tiny config; the torch side is skipped without torch)."""

from __future__ import annotations

import json

import pytest

from benchmarks.vision_tower import IMAGES, main

processor = pytest.importorskip("k3jax.vision.processor")


def test_benchmark_grids_are_the_processors():
    for name, grid in IMAGES.items():
        width, height = (int(v) for v in name.split()[0].split("x"))
        assert processor.resize_plan(width, height).grid == grid


def test_smoke_run_writes_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    assert main(["--smoke", "--out", str(out), "--reps", "1"]) == 0
    result = json.loads(out.read_text())
    assert [r["grid"] for r in result["rows"]] == [[1, 4, 6], [1, 8, 10]]
    assert all(r["jax_ms"] > 0 for r in result["rows"])
    assert "| image | grid | patches | tokens | JAX ms |" in capsys.readouterr().out
