"""`k3jax convert` output: a tqdm bar with bytes/s and ETA on stderr and a summary, or nothing with --quiet."""

from __future__ import annotations

import json

import jax

from k3jax import cli
from k3jax.cli import main


def test_progress_bar_and_summary(tmp_path, golden_dir, capsys):
    assert main(["convert", str(golden_dir), str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "convert: 100%" in err and "B/s" in err and "<00:00" in err  # rate and ETA
    assert "16 item(s) written, 0 already done, 5.8 MiB" in out  # experts kept MXFP4-packed; vision item included


def test_quiet_prints_nothing(tmp_path, golden_dir, capsys):
    assert main(["convert", str(golden_dir), str(tmp_path / "out"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_out_dir_is_required_without_plan_only(golden_dir, capsys):
    assert main(["convert", str(golden_dir)]) == 2
    assert "OUT_DIR is required" in capsys.readouterr().err


def test_no_sync_writes_the_same_checkpoint(tmp_path, golden_dir):
    """--no-sync changes only when data reaches the disk, not what is written."""
    assert main(["convert", str(golden_dir), str(tmp_path / "a"), "--quiet"]) == 0
    assert main(["convert", str(golden_dir), str(tmp_path / "b"), "--quiet", "--no-sync"]) == 0
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("a", "b")]
    assert manifests[0]["items"] == manifests[1]["items"]
    assert (tmp_path / "b" / "COMPLETE").is_file()


def test_convert_joins_the_job_and_several_processes_need_a_mesh(tmp_path, golden_dir, monkeypatch, capsys):
    """Under a multi-process launcher every process runs the same command: without --mesh each would
    write the whole output into the same directory, so that is refused before anything is read."""
    calls = []
    monkeypatch.setattr(cli.distributed, "initialize", lambda: calls.append("initialize"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert main(["convert", str(golden_dir), str(tmp_path / "out")]) == 2
    assert calls == ["initialize"] and not (tmp_path / "out").exists()
    assert "error: this is one of 2 processes; a conversion by several processes needs --mesh SPEC" in \
        capsys.readouterr().err
