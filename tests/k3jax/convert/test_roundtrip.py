"""HF -> convert -> from_pretrained gives the model the HF loader gives, and only when COMPLETE.

The float32 round trip compares logits on the golden checkpoint (and --verify compares them again,
sharing the one compiled forward); the other variants compare every leaf, which implies it.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import CheckpointError
from k3jax.checkpoint.store import COMPLETE, MANIFEST, ItemStore
from k3jax.convert import convert

# Same shape as the --verify logits check in the fixture, so the compiled forward is reused.
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 8)), jnp.int32)


def assert_same_leaves(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_float32_round_trip_gives_the_direct_logits(converted_fp32, golden_model_fp32):
    assert (converted_fp32 / COMPLETE).is_file()
    model = k3jax.from_pretrained(converted_fp32, dtype="float32")
    np.testing.assert_array_equal(np.asarray(model(IDS)), np.asarray(golden_model_fp32(IDS)))


def test_items_are_per_layer_orbax_checkpoints(converted_fp32):
    manifest = json.loads((converted_fp32 / MANIFEST).read_text())
    assert list(manifest["items"]) == ["embed", *(f"layer_{i:03d}" for i in range(13)), "head", "vision"]
    leaves = ItemStore(converted_fp32).restore("layer_004")
    assert leaves["block_sparse_moe.experts.w1.packed"].shape == (16, 64, 32)  # one layer, not a stacked group
    assert leaves["block_sparse_moe.experts.w1.scale"].shape == (16, 64, 2)
    assert manifest["items"]["layer_004"]["self_attn.A_log"]["shape"] == [4]


def test_bfloat16_conversion_loads_as_the_direct_bfloat16_model(tmp_path, golden_dir, golden_model_bf16):
    convert(golden_dir, tmp_path / "bf16", progress=False)
    # packed experts decoded at load time: the same leaves as the release loaded directly
    assert_same_leaves(k3jax.from_pretrained(tmp_path / "bf16", dtype="bfloat16", experts="bf16"), golden_model_bf16)
    packed = k3jax.from_pretrained(golden_dir, dtype="bfloat16", experts="mxfp4")
    assert_same_leaves(k3jax.from_pretrained(tmp_path / "bf16", dtype="bfloat16"), packed)


def test_bf16_experts_in_a_float32_conversion_are_exact(tmp_path, golden_dir, golden_model_fp32):
    convert(golden_dir, tmp_path / "mixed", dtype="float32", experts="bf16", progress=False)
    manifest = json.loads((tmp_path / "mixed" / MANIFEST).read_text())
    assert manifest["items"]["layer_001"]["block_sparse_moe.experts.w2"]["dtype"] == "bfloat16"
    assert manifest["items"]["layer_001"]["block_sparse_moe.gate.weight"]["dtype"] == "float32"
    assert_same_leaves(k3jax.from_pretrained(tmp_path / "mixed", dtype="float32"), golden_model_fp32)


def test_output_without_complete_marker_does_not_load(tmp_path, converted_fp32):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / MANIFEST).write_bytes((converted_fp32 / MANIFEST).read_bytes())
    with pytest.raises(CheckpointError, match="incomplete conversion \\(no COMPLETE marker\\).*--resume"):
        k3jax.from_pretrained(copy)


def test_manifest_edited_after_completion_does_not_load(tmp_path, converted_fp32):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in (MANIFEST, COMPLETE):
        (copy / name).write_bytes((converted_fp32 / name).read_bytes())
    (copy / MANIFEST).write_text((copy / MANIFEST).read_text().replace('"float32"', '"bfloat16"', 1))
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        k3jax.from_pretrained(copy)


def test_verify_finds_a_corrupted_item_and_resume_repairs_it(tmp_path, golden_dir, converted_fp32):
    out = tmp_path / "out"
    convert(golden_dir, out, dtype="float32", progress=False)
    store = ItemStore(out)
    leaves = store.restore("layer_006")
    leaves["self_attn.o_proj.weight"][0, 0] += 1.0
    shutil.rmtree(store.path("layer_006"))
    store.save("layer_006", leaves)  # a silently damaged item under the committed name,
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["layer_006"] = store.files("layer_006")  # whose files look whole to a resume
    (out / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CheckpointError, match="layer_006: leaf self_attn.o_proj.weight: source float32"):
        convert(golden_dir, out, dtype="float32", resume=True, verify=True, progress=False)
    assert not (out / COMPLETE).exists()
    assert "layer_006" not in json.loads((out / MANIFEST).read_text())["items"]

    result = convert(golden_dir, out, dtype="float32", resume=True, verify=True, progress=False)
    assert (result.written, result.skipped) == (1, 15)
    assert json.loads((out / MANIFEST).read_text())["items"] == json.loads((converted_fp32 / MANIFEST).read_text())["items"]
