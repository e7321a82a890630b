"""Converted directory -> sharded model, restored straight into the target NamedShardings.

On the 8 fake CPU devices of tests/conftest.py. The restored leaves must be the unsharded load's,
really split (so the test cannot pass by replicating), and the logits those of the unsharded model
within the fp32 noise of a partitioned forward (tests/sharding explains the bound). `--plan-only
--mesh` must predict exactly the bytes each device then holds.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint.store import ItemStore
from k3jax.cli import main
from k3jax.convert import plan_conversion
from k3jax.convert.report import device_bytes
from sharding import make_mesh, shard_batch
from tests.conftest import rel_rms

MESH = "expert=2,tensor=2,data=2"
IDS = np.random.default_rng(0).integers(0, 512, (2, 8)).astype(np.int32)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8 on CPU)")


@pytest.fixture(scope="module")
def sharded(converted_fp32):
    saved = ItemStore.restore

    def no_host_restore(self, item):
        raise AssertionError("a mesh load must not restore items to host")

    ItemStore.restore = no_host_restore
    try:
        return k3jax.from_pretrained(converted_fp32, dtype="float32", mesh=MESH)
    finally:
        ItemStore.restore = saved


def test_restored_leaves_are_split_and_equal_to_the_unsharded_load(sharded, converted_fp32):
    mesh = make_mesh(MESH)
    unsharded = k3jax.from_pretrained(converted_fp32, dtype="float32")
    leaves, expected = jax.tree.leaves(sharded), jax.tree.leaves(unsharded)
    assert len(leaves) == len(expected)
    for leaf, want in zip(leaves, expected):
        assert leaf.sharding.mesh.shape == mesh.shape and leaf.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))
    assert any(leaf.sharding.shard_shape(leaf.shape) != leaf.shape for leaf in leaves)
    codes = sharded.group_layers[0].block_sparse_moe.experts.w1.packed[...]
    assert codes.sharding.spec[:3] == (None, "expert", "tensor")  # [G, E, F, in/2]: experts and F split
    assert codes.addressable_shards[0].data.shape == (2, 8, 32, 32)
    assert sharded.tail_layers[0].block_sparse_moe.experts.w2.scale[...].sharding.spec[0] == "expert"


def test_sharded_logits_match_the_unsharded_model(sharded, golden_model_fp32):
    logits = sharded(shard_batch(IDS, make_mesh(MESH)))
    assert logits.sharding.device_set == set(make_mesh(MESH).devices.flat)
    assert rel_rms(logits, golden_model_fp32(IDS)) <= 1e-5


def test_decoded_experts_straight_into_the_mesh(converted_fp32, golden_model_fp32):
    model = k3jax.from_pretrained(converted_fp32, dtype="float32", mesh=MESH, experts="bf16")
    w2 = model.group_layers[1].block_sparse_moe.experts.w2[...]
    assert w2.shape == (2, 16, 64, 64) and w2.sharding.spec[1] == "expert"
    for leaf, want in zip(jax.tree.leaves(model), jax.tree.leaves(golden_model_fp32)):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))


def test_plan_only_mesh_predicts_the_bytes_per_device(golden_dir, sharded, capsys):
    report = device_bytes(plan_conversion(golden_dir, dtype="float32").abstract, MESH)
    device = jax.devices()[0]
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(sharded)
               for s in leaf.addressable_shards if s.device == device)
    assert report["per_device"] == held < report["total"]
    assert main(["convert", str(golden_dir), "--plan-only", "--dtype", "float32", "--mesh", MESH]) == 0
    out = capsys.readouterr().out
    assert f"mesh data=2,expert=2,tensor=2 (8 devices): {held} bytes" in out
    assert main(["convert", str(golden_dir), "--plan-only", "--mesh", "expert=2,pipeline=4"]) == 2
    assert "error: --mesh expert=2,pipeline=4: mesh spec" in capsys.readouterr().err
