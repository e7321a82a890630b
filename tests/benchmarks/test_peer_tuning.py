"""The benchmarks' carried peer tuning: fla's Triton autotune results, kept as one archive in the
repository and unpacked into a Triton cache before the peer's first kernel runs."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from benchmarks.torch_peer import TUNED_ARCHIVE, export_autotuning, keep_autotuning


def test_archive_round_trips(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    cache = keep_autotuning(str(TUNED_ARCHIVE))
    assert os.environ["TRITON_CACHE_DIR"] == cache and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    with tarfile.open(TUNED_ARCHIVE) as archive:
        names = sorted(archive.getnames())
    assert names and all(n.endswith(".autotune.json") and n.count("/") == 1 for n in names)
    record = json.loads(sorted(Path(cache).glob("*/*.autotune.json"))[0].read_text())
    assert {"key", "configs_timings"} <= record.keys()
    out = tmp_path / "back.tar.gz"
    assert export_autotuning(cache, str(out)) == len(names)
    with tarfile.open(out) as archive:
        assert sorted(archive.getnames()) == names


@pytest.mark.parametrize("source", [None, ""])
def test_nothing_kept_without_a_source(source, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert keep_autotuning(source) is None
    assert export_autotuning(None, "unused.tar.gz") == 0
