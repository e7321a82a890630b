"""A conversion killed with SIGKILL mid-write resumes to exactly what an uninterrupted run writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

import k3jax
from k3jax.checkpoint import CheckpointError, store
from k3jax.checkpoint.store import COMPLETE, ITEMS, MANIFEST, mark_complete
from k3jax.convert import convert
from tests.k3jax.convert.conftest import k3jax_command, subprocess_env


def _committed(out) -> list[str]:
    try:
        return list(json.loads((out / MANIFEST).read_text())["items"])
    except (OSError, json.JSONDecodeError, KeyError):
        return []


def _kill_mid_item(out, proc: subprocess.Popen, after: int) -> list[str]:
    """SIGKILL once `after` items are committed and the next one is being written (a temporary exists)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        writing = (out / ITEMS).is_dir() and any(".tmp" in p.name for p in (out / ITEMS).iterdir())
        if len(_committed(out)) >= after and writing:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return _committed(out)
        time.sleep(0.002)
    proc.kill()
    pytest.fail(f"conversion ended (rc={proc.poll()}) before it could be killed mid-item")


def test_killed_conversion_resumes_to_the_uninterrupted_result(tmp_path, golden_dir):
    reference = tmp_path / "reference"
    convert(golden_dir, reference, progress=False)

    out = tmp_path / "out"
    proc = subprocess.Popen(k3jax_command("convert", golden_dir, out, "--quiet"), env=subprocess_env())
    committed = _kill_mid_item(out, proc, after=3)
    assert 3 <= len(committed) < 16  # embed, 13 layers, head, vision
    assert not (out / COMPLETE).exists()
    with pytest.raises(CheckpointError, match="incomplete conversion"):
        k3jax.from_pretrained(out)
    with pytest.raises(CheckpointError, match="is not empty; pass --resume"):
        convert(golden_dir, out, progress=False)

    result = convert(golden_dir, out, resume=True, progress=False)
    assert (result.skipped, result.written) == (len(committed), 16 - len(committed))
    assert (out / COMPLETE).is_file()
    assert json.loads((out / MANIFEST).read_text())["items"] == json.loads((reference / MANIFEST).read_text())["items"]
    assert sorted(os.listdir(out / ITEMS)) == sorted(os.listdir(reference / ITEMS))  # no debris left


def test_resume_refuses_different_settings(tmp_path, golden_dir):
    out = tmp_path / "out"
    convert(golden_dir, out, progress=False)
    with pytest.raises(CheckpointError, match="started with dtype='bfloat16' but this run has 'float32'"):
        convert(golden_dir, out, dtype="float32", resume=True, progress=False)
    assert convert(golden_dir, out, resume=True, progress=False).written == 0


def test_resume_refuses_a_directory_that_is_not_a_conversion(tmp_path, golden_dir):
    (tmp_path / "notes.txt").write_text("unrelated")
    with pytest.raises(CheckpointError, match="has no manifest.json: there is no conversion to resume"):
        convert(golden_dir, tmp_path, resume=True, progress=False)


def test_resume_refuses_an_older_manifest_version_which_still_loads(tmp_path, golden_dir):
    out = tmp_path / "out"
    convert(golden_dir, out, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["version"], manifest["checksum"]) == (2, "crc32")
    manifest["version"] = 1
    del manifest["checksum"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json: a k3jax-converted v1 manifest \(checksums: sha256\); "
                                              r"this converter resumes only v2 \(crc32\) conversions"):
        convert(golden_dir, out, resume=True, progress=False)
    mark_complete(out)
    k3jax.from_pretrained(out)  # loading reads only shapes and dtypes, which v1 records too


def test_unsynced_conversion_commits_the_same_items_without_fsync(tmp_path, golden_dir, monkeypatch):
    convert(golden_dir, tmp_path / "synced", progress=False)
    synced: list = []
    monkeypatch.setattr(store, "_fsync", synced.append)
    convert(golden_dir, tmp_path / "unsynced", sync=False, progress=False)
    assert synced == []
    items = [json.loads((tmp_path / name / MANIFEST).read_text())["items"] for name in ("synced", "unsynced")]
    assert items[0] == items[1]
