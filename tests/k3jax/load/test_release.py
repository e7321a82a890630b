"""Loading HF release directories: name mapping variants, clear errors for bad checkpoints, and the
release read straight onto a mesh.

Variants are written from the golden checkpoint's own tensors as single-file checkpoints, so the
loaded model must give exactly the golden model's logits.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import CheckpointError, CheckpointIndex
from pallas_kernels.mxfp4 import decode_mxfp4
from k3jax.load import release
from tests.conftest import rel_rms, write_variant

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 20)), jnp.int32)


@pytest.fixture(scope="module")
def golden_tensors(golden_dir) -> dict[str, np.ndarray]:
    index = CheckpointIndex.open(golden_dir)
    return {name: index.read(name) for name in index.names()}


@pytest.fixture(scope="module")
def golden_logits(golden_model_fp32):
    return np.asarray(golden_model_fp32(IDS))


def test_text_only_names_without_prefix(tmp_path, golden_dir, golden_tensors, golden_logits):
    text_only = {
        name.removeprefix("language_model."): t for name, t in golden_tensors.items()
        if name.startswith("language_model.")
    }
    model = k3jax.from_pretrained(write_variant(tmp_path / "m", golden_dir, text_only), dtype="float32")
    np.testing.assert_array_equal(np.asarray(model(IDS)), golden_logits)


def test_plain_bf16_experts_and_unpadded_a_log(tmp_path, golden_dir, golden_tensors, golden_logits):
    """Experts stored as `.weight` (MXFP4 values are exact in bf16) and A_log already [num_heads]."""
    tensors = {}
    for name, t in golden_tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            tensors[base] = decode_mxfp4(t, golden_tensors[base + "_scale"]).astype(ml_dtypes.bfloat16)
        elif name.endswith("A_log"):
            tensors[name] = t[:4]
        else:
            tensors[name] = t
    model = k3jax.from_pretrained(write_variant(tmp_path / "m", golden_dir, tensors), dtype="float32")
    np.testing.assert_array_equal(np.asarray(model(IDS)), golden_logits)


MISSING = "language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight_scale"
MISSHAPED = "language_model.model.layers.2.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(MISSING), "experts.3.w2.weight_scale is missing"),
        (lambda t: t.pop("language_model.model.norm.weight"), "model.norm.weight is missing"),
        (lambda t: t.update({"language_model.model.layers.1.extra.weight": np.zeros(2, np.float32)}),
         "unexpected tensor.*layers.1.extra.weight"),
        (lambda t: t.update({MISSHAPED: t[MISSHAPED][:, :-1]}), "q_proj.weight has shape \\[128, 127\\].*expects \\[128, 128\\]"),
        (lambda t: t.update({"language_model.model.layers.0.self_attn.A_log": np.ones(32, np.float32)}),
         "A_log: entries past the 4 heads must be zero"),
    ],
    ids=["missing-expert-scale", "missing-norm", "unexpected", "misshaped", "a-log-padding"],
)
def test_bad_checkpoints_name_the_tensor(tmp_path, golden_dir, golden_tensors, edit, message):
    tensors = dict(golden_tensors)
    edit(tensors)
    with pytest.raises(CheckpointError, match=message):
        k3jax.from_pretrained(write_variant(tmp_path / "m", golden_dir, tensors), dtype="float32")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        k3jax.from_pretrained(tmp_path)


def test_config_that_does_not_match_the_checkpoint(tmp_path, golden_dir, golden_tensors):
    root = write_variant(tmp_path / "m", golden_dir, dict(golden_tensors))
    config = json.loads((root / "config.json").read_text())
    config["text_config"]["num_experts"] = 8
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="e_score_correction_bias has shape \\[16\\], the model expects \\[8\\]"):
        k3jax.from_pretrained(root, dtype="float32")


def test_release_onto_a_mesh_reads_each_piece_into_its_sharding(golden_dir, golden_model_fp32, monkeypatch):
    """On a mesh the release is read region by region into the shardings: never a whole item on the
    host, and the leaves are the unsharded load's, really split."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (jax_num_cpu_devices=8 on CPU)")

    def no_host_items(*args, **kwargs):
        raise AssertionError("a mesh load must not materialise whole items on the host")

    monkeypatch.setattr(release, "materialize_item", no_host_items)
    model = k3jax.from_pretrained(golden_dir, dtype="float32", mesh="expert=2,tensor=2,data=2")
    leaves, expected = jax.tree.leaves(model), jax.tree.leaves(golden_model_fp32)
    assert len(leaves) == len(expected)
    for leaf, want in zip(leaves, expected):
        assert leaf.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))
    w1 = model.group_layers[0].block_sparse_moe.experts.w1[...]
    assert w1.sharding.spec[:2] == (None, "expert") and w1.addressable_shards[0].data.shape[1] == w1.shape[1] // 2
    assert rel_rms(model(IDS), golden_model_fp32(IDS)) <= 1e-5  # fp32 noise of a partitioned forward
