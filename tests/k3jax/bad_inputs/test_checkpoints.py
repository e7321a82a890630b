"""Bad checkpoints, releases and conversion outputs: each is a clear error naming what is at fault
(or, for a damaged output being resumed, is repaired), never a silent success.

The golden release is converted once per module; each case works on its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import CheckpointError, CheckpointIndex
from k3jax.checkpoint.release_writer import write_release
from k3jax.checkpoint.safetensors_index import INDEX_FILE
from k3jax.checkpoint.store import COMPLETE, ITEMS, MANIFEST, ItemStore
from k3jax.cli import main
from k3jax.convert import convert
from k3jax.load import release as release_loader
from sharding import make_mesh, shard_batch
from tests.k3jax.convert.conftest import golden_config

LM_HEAD = "language_model.lm_head.weight"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, golden_dir) -> Path:
    out = tmp_path_factory.mktemp("converted") / "out"
    convert(golden_dir, out, progress=False)
    return out


@pytest.fixture
def output(tmp_path, converted) -> Path:
    """A private copy of the converted golden release."""
    return Path(shutil.copytree(converted, tmp_path / "out", symlinks=True))


@pytest.fixture
def release(tmp_path, golden_dir) -> Path:
    """A private copy of the golden release (shards linked, not copied: the cases edit only the index)."""
    root = tmp_path / "hf"
    root.mkdir()
    for entry in golden_dir.iterdir():
        if entry.suffix in (".json", ".safetensors"):
            shutil.copy(entry, root / entry.name)
    return root


def _remove_item(out: Path) -> None:
    shutil.rmtree(out / ITEMS / "layer_003")


def _truncate_item_file(out: Path) -> None:
    files = sorted((p for p in (out / ITEMS / "layer_003").rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
    files[0].write_bytes(files[0].read_bytes()[:-1])


def _remove_item_file(out: Path) -> None:
    files = sorted(p for p in (out / ITEMS / "layer_003").rglob("*") if p.is_file())
    files[-1].unlink()


@pytest.mark.parametrize("damage", [_remove_item, _truncate_item_file, _remove_item_file],
                         ids=["item-removed", "file-truncated", "file-removed"])
def test_resume_redoes_damaged_items(output, golden_dir, converted, damage):
    damage(output)
    result = convert(golden_dir, output, resume=True, progress=False)
    assert (result.written, result.skipped) == (1, 15)
    assert (output / COMPLETE).is_file()
    read = lambda root: json.loads((root / MANIFEST).read_text())["items"]  # noqa: E731
    assert read(output) == read(converted)
    k3jax.from_pretrained(output)


def test_resume_of_an_older_manifest_checks_checksums_and_records_files(output, golden_dir):
    manifest = json.loads((output / MANIFEST).read_text())
    del manifest["files"]
    (output / MANIFEST).write_text(json.dumps(manifest))
    _remove_item(output)
    result = convert(golden_dir, output, resume=True, progress=False)
    assert (result.written, result.skipped) == (1, 15)
    assert len(json.loads((output / MANIFEST).read_text())["files"]) == 16  # embed, 13 layers, head, vision


def test_resume_never_deletes_through_a_linked_items_folder(tmp_path, output, golden_dir, capsys):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(output / ITEMS, elsewhere)
    (elsewhere / "precious.txt").write_text("keep me")
    os.symlink(elsewhere, output / ITEMS)
    assert main(["convert", str(golden_dir), str(output), "--resume", "--quiet"]) == 1
    assert capsys.readouterr().err == f"error: {output / ITEMS} is a symbolic link; a conversion output must hold " \
                                      "its own files (nothing is deleted or written through a link)\n"
    assert (elsewhere / "precious.txt").read_text() == "keep me"
    assert len(list(elsewhere.iterdir())) == 17  # 16 items and precious.txt


def test_resume_refuses_a_link_inside_the_output(tmp_path, output, golden_dir):
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    os.symlink(target, output / ITEMS / "stray")
    with pytest.raises(CheckpointError, match=f"{output / ITEMS / 'stray'} is a symbolic link"):
        convert(golden_dir, output, resume=True, progress=False)
    assert (target / "precious.txt").is_file()


def test_leftover_links_are_removed_themselves(tmp_path, output):
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    os.symlink(target, output / ITEMS / "stray")
    os.symlink(target / "precious.txt", output / ITEMS / "stray-file")
    ItemStore(output).remove_all_but(set(json.loads((output / MANIFEST).read_text())["items"]))
    assert not (output / ITEMS / "stray").is_symlink() and not (output / ITEMS / "stray-file").is_symlink()
    assert (target / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../x.safetensors", r"'\.\./x\.safetensors': a shard must be a relative path inside"),
        ("/etc/passwd", r"'/etc/passwd': a shard must be a relative path inside"),
        ("sub/../../x.safetensors", r"a shard must be a relative path inside"),
        ("folder", r"folder is a directory, not a shard file"),
        ("escape.safetensors", r"escape\.safetensors is a link to /etc/passwd, outside"),
    ],
    ids=["dotdot", "absolute", "nested-dotdot", "directory", "link-out"],
)
def test_index_shard_paths_stay_inside_the_release(release, capsys, shard, message):
    (release / "folder").mkdir()
    os.symlink("/etc/passwd", release / "escape.safetensors")
    index = json.loads((release / INDEX_FILE).read_text())
    index["weight_map"][LM_HEAD] = shard
    (release / INDEX_FILE).write_text(json.dumps(index))
    pattern = f"{release / INDEX_FILE}: maps tensors \\(e\\.g\\. '{LM_HEAD}'\\).*{message}"
    with pytest.raises(CheckpointError, match=pattern):
        CheckpointIndex.open(release)
    assert main(["convert", str(release), str(release.parent / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "header length" not in err


def test_hub_snapshot_links_into_blobs_are_inside(tmp_path, golden_dir):
    repo = tmp_path / "models--moonshotai--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for entry in golden_dir.iterdir():
        if entry.suffix in (".json", ".safetensors"):
            shutil.copy(entry, blobs / entry.name)
            os.symlink(f"../../blobs/{entry.name}", snapshot / entry.name)
    assert len(CheckpointIndex.open(snapshot).names()) == len(CheckpointIndex.open(golden_dir).names())


def _relabel(release: Path, tensor: str, dtype: str) -> None:
    """Change one tensor's dtype in its shard header, keeping the header's length (pads with spaces)."""
    shard = release / json.loads((release / INDEX_FILE).read_text())["weight_map"][tensor]
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header[tensor]["dtype"] = dtype
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= length
    shard.write_bytes(data[:8] + blob.ljust(length) + data[8 + length:])


A_LOG = "language_model.model.layers.0.self_attn.A_log"
BIAS = "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
SCALE = "language_model.model.layers.3.block_sparse_moe.experts.5.w1.weight_scale"
PACKED = "language_model.model.layers.3.block_sparse_moe.experts.5.w1.weight_packed"
Q_PROJ = "language_model.model.layers.2.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("tensor", "dtype", "message"),
    [
        (Q_PROJ, "F16", f"tensor {Q_PROJ} has dtype float16, expected bfloat16"),
        (LM_HEAD, "F16", f"tensor {LM_HEAD} has dtype float16, expected bfloat16"),
        (A_LOG, "I32", f"tensor {A_LOG} has dtype int32, expected a floating-point tensor"),
        (BIAS, "U32", f"tensor {BIAS} has dtype uint32, expected a floating-point tensor"),
        (SCALE, "F8_E8M0", f"tensor {SCALE} has dtype float8_e8m0fnu, MXFP4 needs uint8"),
        (PACKED, "I8", f"tensor {PACKED} has dtype int8, MXFP4 needs uint8"),
    ],
    ids=["bf16-as-f16", "head-as-f16", "a-log-as-int", "bias-as-uint", "scale-as-e8m0", "codes-as-int8"],
)
@pytest.mark.parametrize("dtype_out", ["bfloat16", "float32"])
def test_relabelled_tensor_dtypes_fail_in_planning(release, tmp_path, capsys, tensor, dtype, message, dtype_out):
    _relabel(release, tensor, dtype)
    assert main(["convert", str(release), str(tmp_path / "out"), "--dtype", dtype_out, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        k3jax.from_pretrained(release, dtype=dtype_out)


def _flip_a_byte(out: Path, item: str) -> None:
    """Flip one byte in the middle of the item's largest file (its array data)."""
    largest = max((p for p in (out / ITEMS / item).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x10
    largest.write_bytes(bytes(data))


@pytest.mark.parametrize("mesh", [None, "expert=2,data=-1"], ids=["host", "mesh"])
def test_verify_while_loading_names_the_item_with_a_flipped_byte(output, mesh):
    k3jax.from_pretrained(output, verify=True, mesh=mesh)  # whole: loads
    _flip_a_byte(output, "layer_004")
    k3jax.from_pretrained(output, mesh=mesh)  # without verify, only names, shapes and dtypes are checked
    with pytest.raises(CheckpointError, match=f"{output}: item 'layer_004' does not match the manifest's checksums"):
        k3jax.from_pretrained(output, verify=True, mesh=mesh)


def test_verify_while_loading_a_release_is_refused(golden_dir):
    with pytest.raises(ValueError, match="verify=True checks the checksums of a `k3jax convert` directory"):
        k3jax.from_pretrained(golden_dir, verify=True)


def test_relative_paths_convert_and_load(tmp_path, golden_dir, converted, monkeypatch, capsys):
    shutil.copytree(golden_dir, tmp_path / "hf", ignore=shutil.ignore_patterns("reference", "README.md"))
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "hf", "out/", "--quiet"]) == 0, capsys.readouterr().err  # the README's form
    assert (tmp_path / "out" / COMPLETE).is_file()
    shutil.rmtree(tmp_path / "out" / ITEMS / "head")
    assert convert("hf", "out", resume=True, progress=False).written == 1
    convert("hf", "mesh-out", mesh="expert=2,data=-1", progress=False)
    read = lambda root: json.loads((root / MANIFEST).read_text())["items"]  # noqa: E731
    assert read(tmp_path / "out") == read(tmp_path / "mesh-out") == read(converted)
    k3jax.from_pretrained("out", verify=True)
    k3jax.from_pretrained("out", mesh="expert=2,data=-1")
    k3jax.from_pretrained("hf")


@pytest.fixture(scope="module")
def twelve_experts(tmp_path_factory, golden_dir) -> tuple[Path, Path]:
    """A random release with 12 routed experts, and its conversion."""
    root = tmp_path_factory.mktemp("twelve")
    release = write_release(root / "hf", golden_config(golden_dir, num_experts=12))
    convert(release, root / "out", progress=False)
    return release, root / "out"


@pytest.mark.parametrize("road", [0, 1], ids=["release", "converted"])
@pytest.mark.parametrize(
    ("mesh", "message"),
    [("expert=8", "mesh axis 'expert' has size 8, which does not divide the config's num_experts=12"),
     ("expert=4,tensor=2", None), ("tensor=8", None)],
    ids=["expert-8", "expert-4", "tensor-8-heads-replicated"],
)
def test_mesh_must_split_the_experts_evenly(twelve_experts, monkeypatch, road, mesh, message):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (jax_num_cpu_devices=8 on CPU)")
    if message is None:
        model = k3jax.from_pretrained(twelve_experts[road], mesh=mesh)
        model(shard_batch(np.zeros((2, 8), np.int32), make_mesh(mesh)))  # a forward runs on it
        return
    monkeypatch.setattr(ItemStore, "restore_sharded", lambda *a: pytest.fail("read before the mesh was checked"))
    monkeypatch.setattr(release_loader, "leaf_array", lambda *a: pytest.fail("read before the mesh was checked"))
    with pytest.raises(ValueError, match=message):
        k3jax.from_pretrained(twelve_experts[road], mesh=mesh)


def test_plan_only_refuses_a_mesh_that_does_not_split_the_experts(twelve_experts, capsys):
    assert main(["convert", str(twelve_experts[0]), "--plan-only", "--mesh", "expert=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mesh expert=8: mesh axis 'expert' has size 8, which does not divide the "
                          "config's num_experts=12") and "Traceback" not in err


def test_single_file_release_linked_outside_is_refused(tmp_path):
    root = tmp_path / "hf"
    root.mkdir()
    os.symlink("/etc/passwd", root / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{root / 'model.safetensors'} is a link to /etc/passwd, outside {root}"):
        CheckpointIndex.open(root)
