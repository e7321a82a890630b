"""`convert(..., mesh=...)`: shard-local reads, the single-host output, resumable.

On the 8 fake CPU devices of tests/conftest.py. Every source read is counted per tensor (the one
low-level reader, `safetensors_index._read_bytes`) and attributed to the read box being built. In one
process each read box is read once, so the bytes read are the source bytes exactly on any mesh: an
expert leaf on expert=8 is 8 reads of 2 of its 16 experts each; a leaf replicated over the mesh is read
once (by the one process; with P processes it would be read P times).
"""

from __future__ import annotations

import json
import re

import jax
import ml_dtypes
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import CheckpointError, region, safetensors_index
from k3jax.checkpoint.region import STACKED_KINDS
from k3jax.checkpoint.store import COMPLETE, ITEMS, MANIFEST
from k3jax.cli import main
from k3jax.convert import convert, plan_conversion, sharded
from sharding import make_mesh, shard_batch
from tests.conftest import write_variant

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8 on CPU)")

IDS = np.random.default_rng(0).integers(0, 512, (2, 8)).astype(np.int32)
SPLIT_MESH = "expert=2,tensor=2,data=2"  # experts, rows and columns split; data replicates


def manifest_items(out) -> dict:
    return json.loads((out / MANIFEST).read_text())["items"]


class ReadLog:
    """Bytes read per tensor, grouped by the (item, leaf, box) read they belong to."""

    def __init__(self, monkeypatch) -> None:
        self.reads: list[tuple[str, tuple, dict[str, int]]] = []
        real_read_box, real_read_bytes = region.read_box, safetensors_index._read_bytes

        def read_box(leaf, index, box):
            self.reads.append((leaf, box, {}))
            return real_read_box(leaf, index, box)

        def read_bytes(info, offset, nbytes):
            if not self.reads:  # a read outside any read box: counted, so the totals show it
                self.reads.append((None, None, {}))
            tensors = self.reads[-1][2]
            tensors[info.name] = tensors.get(info.name, 0) + nbytes
            return real_read_bytes(info, offset, nbytes)

        monkeypatch.setattr(region, "read_box", read_box)
        monkeypatch.setattr(safetensors_index, "_read_bytes", read_bytes)

    def total(self) -> int:
        return sum(sum(tensors.values()) for _, _, tensors in self.reads)


@pytest.fixture(scope="module")
def fp32_plan(golden_dir):
    return plan_conversion(golden_dir, dtype="float32").plan


def test_expert_leaf_reads_only_its_experts_and_the_source_once(tmp_path, golden_dir, converted_fp32, fp32_plan,
                                                                 monkeypatch):
    log = ReadLog(monkeypatch)
    convert(golden_dir, tmp_path / "out", dtype="float32", mesh="expert=8", progress=False)
    reads_per_leaf: dict[str, list] = {}
    for leaf, box, tensors in log.reads:
        reads_per_leaf.setdefault(id(leaf), []).append((leaf, box, tensors))
    expert_leaves = 0
    for reads in reads_per_leaf.values():
        leaf = reads[0][0]
        if leaf.kind in STACKED_KINDS:  # [16 experts, rows, cols] on 8 devices: 2 experts per device read
            expert_leaves += 1
            assert len(reads) == 8
            for _, ((e0, e1), rows), tensors in reads:
                assert e1 - e0 == 2 and rows == (0, leaf.shape[1])
                experts = {int(re.search(r"\.experts\.(\d+)\.", name).group(1)) for name in tensors}
                assert experts == {e0, e1 - 1}
                assert sum(tensors.values()) == leaf.source_bytes // 8
        elif len(reads) > 1:  # the router's [16 experts, latent] rows are split over `expert` too
            assert [box for _, box, _ in reads] == [((2 * d, 2 * d + 2),) for d in range(8)]
        # else replicated over expert=8: one read of the whole leaf, not one per device
        assert sum(sum(tensors.values()) for _, _, tensors in reads) == leaf.source_bytes
    assert expert_leaves == sum(leaf.kind in STACKED_KINDS for item in fp32_plan.items for leaf in item.leaves) > 0
    assert log.total() == fp32_plan.source_bytes
    assert manifest_items(tmp_path / "out") == manifest_items(converted_fp32)


@pytest.fixture(scope="module")
def split_conversion(tmp_path_factory, golden_dir):
    out = tmp_path_factory.mktemp("sharded") / "split"
    convert(golden_dir, out, dtype="float32", mesh=SPLIT_MESH, verify=True, progress=False)
    return out


def test_split_mesh_gives_the_single_host_output_and_reads_the_source_once(
        tmp_path, golden_dir, converted_fp32, fp32_plan, split_conversion, monkeypatch):
    assert (split_conversion / COMPLETE).is_file()  # and --verify passed: on-disk == source == manifest
    assert manifest_items(split_conversion) == manifest_items(converted_fp32)
    log = ReadLog(monkeypatch)
    convert(golden_dir, tmp_path / "again", dtype="float32", mesh=make_mesh(SPLIT_MESH), progress=False)
    assert log.total() == fp32_plan.source_bytes  # column-split leaves: full rows read once, sliced per device


def test_sharded_restore_gives_the_direct_release_logits(split_conversion, golden_dir):
    mesh = make_mesh(SPLIT_MESH)
    converted = k3jax.from_pretrained(split_conversion, dtype="float32", mesh=mesh)
    direct = k3jax.from_pretrained(golden_dir, dtype="float32", mesh=mesh)
    np.testing.assert_array_equal(np.asarray(converted(shard_batch(IDS, mesh))),
                                  np.asarray(direct(shard_batch(IDS, mesh))))


def test_dense_experts_decode_per_slice(tmp_path, golden_dir):
    convert(golden_dir, tmp_path / "host", dtype="float32", experts="bf16", progress=False)
    convert(golden_dir, tmp_path / "mesh", dtype="float32", experts="bf16", mesh=SPLIT_MESH, progress=False)
    assert manifest_items(tmp_path / "mesh") == manifest_items(tmp_path / "host")


class Killed(Exception):
    pass


def test_interrupted_sharded_conversion_resumes(tmp_path, golden_dir, converted_fp32, monkeypatch):
    out = tmp_path / "out"
    real_save, saved = sharded._save, []

    def save_then_die(store, checkpointer, item, leaves):
        if len(saved) == 4:  # the fifth item dies half written: its temporary exists, uncommitted
            (store.items / f"{item}.tmp").mkdir()
            raise Killed
        real_save(store, checkpointer, item, leaves)
        saved.append(item)

    monkeypatch.setattr(sharded, "_save", save_then_die)
    with pytest.raises(Killed):
        convert(golden_dir, out, dtype="float32", mesh="expert=8", progress=False)
    assert list(manifest_items(out)) == saved and not (out / COMPLETE).exists()
    monkeypatch.setattr(sharded, "_save", real_save)

    result = convert(golden_dir, out, dtype="float32", mesh=SPLIT_MESH, resume=True, progress=False)
    assert (result.skipped, result.written) == (4, 12)
    assert (out / COMPLETE).is_file()
    assert manifest_items(out) == manifest_items(converted_fp32)
    assert sorted(p.name for p in (out / ITEMS).iterdir()) == sorted(manifest_items(out))  # no debris
    # items written on a mesh restore to host anywhere, like the single-host ones
    for a, b in zip(jax.tree.leaves(k3jax.from_pretrained(out, dtype="float32")),
                    jax.tree.leaves(k3jax.from_pretrained(converted_fp32, dtype="float32"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_mesh_conversion(tmp_path, golden_dir, converted_fp32, capsys):
    assert main(["convert", str(golden_dir), str(tmp_path / "out"), "--dtype", "float32", "--mesh", "expert=8",
                 "--quiet"]) == 0
    assert manifest_items(tmp_path / "out") == manifest_items(converted_fp32)
    assert main(["convert", str(golden_dir), str(tmp_path / "bad"), "--mesh", "expert=3", "--quiet"]) == 2
    err = capsys.readouterr().err  # checked before anything is read, as generate's --mesh
    assert "error: --mesh: mesh spec 'expert=3': axis sizes multiply to 3, but there are 8 devices" in err
    assert not (tmp_path / "bad").exists()


def test_non_finite_value_in_a_slice_names_the_tensor_and_rows(tmp_path, golden_dir, golden_tensors):
    name = "language_model.model.layers.2.self_attn.q_proj.weight"
    poisoned = golden_tensors[name].astype(np.float32)
    poisoned[-1, 3] = np.nan  # last row: read by the device holding the last rows only
    source = write_variant(tmp_path / "hf", golden_dir, {**golden_tensors, name: poisoned.astype(ml_dtypes.bfloat16)})
    rows = poisoned.shape[0]
    with pytest.raises(CheckpointError, match=rf"tensor {name} holds 1 NaN and 0 inf .*rows \[{rows // 8 * 7}, {rows}\)"):
        convert(source, tmp_path / "out", mesh="tensor=8", progress=False)
    assert not (tmp_path / "out" / COMPLETE).exists()
