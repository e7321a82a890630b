"""The conversion plan: built from headers only, complete against the abstract model, printed by --plan-only."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from flax import nnx

from k3jax.checkpoint import CheckpointError, CheckpointIndex, transform
from pallas_kernels.mxfp4 import decode_mxfp4
from k3jax.checkpoint.names import abstract_items
from k3jax.cli import main
from k3jax.config import K3Config
from k3jax.convert import plan_conversion
from k3jax.model import K3Model
from tests.conftest import write_variant


def test_plan_is_built_from_headers_only(golden_dir, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("the plan must not read tensor data")

    monkeypatch.setattr(CheckpointIndex, "read", no_data)
    monkeypatch.setattr(CheckpointIndex, "read_slice", no_data)
    assert plan_conversion(golden_dir).plan.nbytes > 0


def test_plan_matches_the_abstract_model_per_layer(golden_dir):
    plan = plan_conversion(golden_dir, dtype="float32", experts="bf16").plan
    cfg = K3Config.from_hf(golden_dir, dtype="float32")
    abstract = nnx.eval_shape(lambda: K3Model.init(cfg))
    expected = abstract_items(abstract)
    assert [item.name for item in plan.items] == ["embed", *(f"layer_{i:03d}" for i in range(13)), "head", "vision"]
    for item in plan.items:
        targets = {slot.target: leaf for slot, leaf in expected[item.name].items()}
        assert [leaf.target for leaf in item.leaves] == list(targets)
        for leaf in item.leaves:
            assert leaf.shape == targets[leaf.target].shape
            is_expert = leaf.target.startswith("block_sparse_moe.experts.")
            assert leaf.dtype == (np.dtype("bfloat16") if is_expert else np.dtype(targets[leaf.target].dtype))

    w2 = plan.item("layer_005").leaf("block_sparse_moe.experts.w2")
    assert w2.kind == "experts" and len(w2.parts) == 16
    assert w2.parts[3] == ("language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight_packed",
                           "language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight_scale")
    a_log = plan.item("layer_000").leaf("self_attn.A_log")
    assert (a_log.kind, a_log.shape, a_log.transform) == ("a_log", (4,), "A_log slice [32] -> [4]")
    assert plan.item("head").leaf("lm_head.weight").parts == (("language_model.lm_head.weight",),)
    assert plan.item("layer_002").leaf("self_attn.q_proj.weight").transform == "cast bfloat16 -> float32"
    wqkv = plan.item("vision").leaf("vision_tower.encoder.blocks.1.wqkv.weight")
    assert (wqkv.parts, wqkv.shape) == ((("vision_tower.encoder.blocks.1.wqkv.weight",),), (288, 64))


def test_plan_only_prints_bytes_per_leaf_and_totals(golden_dir, capsys, tmp_path):
    plan = plan_conversion(golden_dir, experts="bf16").plan
    assert main(["convert", str(golden_dir), "--plan-only", "--experts", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "block_sparse_moe.experts.w1" in out
    assert "stack 16 experts, MXFP4 decode -> bfloat16" in out
    assert "layers.1.block_sparse_moe.experts.{0..15}.w1.weight_{packed,scale}" in out
    assert f"items: 16, leaves: {sum(len(i.leaves) for i in plan.items)}" in out  # embed, 13 layers, head, vision
    assert f"total: {plan.nbytes} bytes written" in out
    assert f"from {plan.source_bytes} bytes read" in out
    row = next(line for line in out.splitlines() if line.startswith("embed "))
    assert row.split()[:5] == ["embed", "embed_tokens.weight", "512x128", "bfloat16", str(512 * 128 * 2)]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("language_model.model.layers.7.block_sparse_moe.experts.9.w1.weight_scale"),
         "experts.9.w1.weight_scale is missing"),
        (lambda t: t.update({"language_model.model.layers.3.self_attn.o_proj.weight": np.zeros((3, 3), np.float32)}),
         "o_proj.weight has shape \\[3, 3\\], the model expects \\[128, 128\\]"),
        (lambda t: t.update({"language_model.model.layers.4.block_sparse_moe.experts.0.w3.weight_packed":
                             np.zeros((64, 16), np.uint8)}),
         "experts.0.w3.weight_packed has shape \\[64, 16\\], the model expects \\[64, 32\\] \\(MXFP4 packing"),
        (lambda t: t.update({"language_model.model.norm.weight": np.zeros(128, np.int32)}),
         "norm.weight has dtype int32, expected a floating-point tensor"),
        (lambda t: t.update({"language_model.model.layers.12.stray": np.zeros(2, np.float32)}),
         "1 unexpected tensor.*layers.12.stray"),
    ],
    ids=["missing", "misshaped", "mxfp4-misshaped", "integer", "unexpected"],
)
def test_bad_release_fails_in_planning_before_any_write(tmp_path, golden_dir, golden_tensors, capsys, edit, message):
    tensors = dict(golden_tensors)
    edit(tensors)
    source = write_variant(tmp_path / "hf", golden_dir, tensors)
    assert main(["convert", str(source), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_mxfp4_release_plans_packed_experts_by_default(golden_dir, capsys):
    plan = plan_conversion(golden_dir).plan
    assert plan_conversion(golden_dir, experts="mxfp4").plan.fingerprint == plan.fingerprint
    codes = plan.item("layer_005").leaf("block_sparse_moe.experts.w2.packed")
    scales = plan.item("layer_005").leaf("block_sparse_moe.experts.w2.scale")
    assert (codes.kind, codes.shape, codes.dtype, scales.shape) == ("mxfp4_packed", (16, 64, 32), np.uint8, (16, 64, 2))
    assert codes.parts[3][0].endswith("layers.5.block_sparse_moe.experts.3.w2.weight_packed")
    # 4.25 bits per weight: the written experts are the source's bytes, nothing decoded
    experts = [leaf for item in plan.items for leaf in item.leaves if leaf.kind.startswith("mxfp4")]
    weights = sum(leaf.shape[0] * leaf.shape[1] * leaf.shape[2] * 2 for leaf in experts if leaf.kind == "mxfp4_packed")
    assert sum(leaf.nbytes for leaf in experts) * 8 / weights == 4.25
    assert sum(leaf.nbytes for leaf in experts) == sum(leaf.source_bytes for leaf in experts)
    assert main(["convert", str(golden_dir), "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "stack 16 experts, MXFP4 E8M0 scales as stored (no decode)" in out
    assert "layers.1.block_sparse_moe.experts.{0..15}.w1.weight_scale" in out


def test_packed_experts_need_an_mxfp4_release(tmp_path, golden_dir, golden_tensors):
    tensors = dict(golden_tensors)
    base = "language_model.model.layers.2.block_sparse_moe.experts.7.w3"
    packed, scale = tensors.pop(f"{base}.weight_packed"), tensors.pop(f"{base}.weight_scale")
    tensors[f"{base}.weight"] = decode_mxfp4(packed, scale).astype(golden_tensors[Q_NAME].dtype)
    source = write_variant(tmp_path / "hf", golden_dir, tensors)
    assert plan_conversion(source).settings["experts"] is None  # auto: not every expert is MXFP4 -> decoded
    with pytest.raises(CheckpointError, match=f"tensor {base}.weight is not MXFP4-packed.*--experts bf16"):
        plan_conversion(source, experts="mxfp4")


Q_NAME = "language_model.model.layers.2.self_attn.q_proj.weight"


@pytest.mark.parametrize("shared_buffer_short_reads", [False, True])
@pytest.mark.parametrize(("dtype", "experts"), [("bfloat16", "mxfp4"), ("bfloat16", "bf16"), ("float32", None)])
def test_item_reads_in_file_order_equal_the_per_leaf_reference(golden_dir, dtype, experts, shared_buffer_short_reads,
                                                               monkeypatch):
    """The converter's coalesced, file-ordered reads and table MXFP4 decode == `materialize`, bit for bit,
    also into one dirty buffer reused by every item, and when the kernel returns short reads."""
    planned = plan_conversion(golden_dir, dtype=dtype, experts=experts)
    monkeypatch.setattr(transform, "READ_RUN_BYTES", 40_000)  # several runs per shard, tensors split across
    monkeypatch.setattr(transform, "_IOV_MAX", 3)  # several preadv calls per run
    buffer = None
    if shared_buffer_short_reads:
        preadv = os.preadv
        monkeypatch.setattr(transform.os, "preadv", lambda fd, views, at: preadv(fd, [views[0][:777]], at))
        buffer = np.full(max(transform.item_buffer_bytes(item) for item in planned.plan.items), 0xA5, np.uint8)
    for item in planned.plan.items:
        got = transform.materialize_item(item, planned.index, buffer)
        assert list(got) == [leaf.target for leaf in item.leaves]
        for leaf in item.leaves:
            want = transform.materialize(leaf, planned.index)
            assert got[leaf.target].dtype == want.dtype and got[leaf.target].shape == want.shape
            np.testing.assert_array_equal(got[leaf.target].view(np.uint8), want.view(np.uint8))
