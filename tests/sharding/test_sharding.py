"""Sharded inference on 8 fake CPU devices (tests/conftest.py sets jax_num_cpu_devices=8).

For three meshes the golden tiny model, sharded by DEFAULT_RULES, must give the unsharded model's
logits and greedy tokens, with some parameters really split, so the test cannot pass by replicating.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import k3jax
from k3jax.nn.kda import KDACache
from k3jax.nn.mla import MLACache
from sharding import (
    DEFAULT_RULES, abstract_mesh, cache_shardings, logical_to_spec, make_mesh, mesh_device_count, param_shardings, parse_mesh_spec,
    shard_batch, shard_cache, shard_model,
)
from tests.conftest import GOLDEN_DIR, rel_rms

MESHES = ["expert=8", "data=2,expert=2,tensor=2", "fsdp=2,expert=2,tensor=2"]
NEW_TOKENS = 8

# Sharded vs unsharded fp32 logits. The math is the same; what changes is the order of reductions: a
# contraction over a split `embed` or head dim is summed per device and then all-reduced, and every
# per-device matmul has other shapes, so the CPU kernels block it differently. Each such change is
# ~1e-7 relative, and 13 layers (KDA decays, softmaxes over depth and keys) amplify it: the unsharded
# model on one device already differs by 2.5e-6 rel-RMS between batch 1 and batch 2 of the same rows.
# So 1e-6 is below the model's own fp32 noise; sharding measures 1.4e-6 .. 2.9e-6, and the bound is
# 1e-5. A sharding bug (a wrong split, a missing all-reduce, a misrouted token) costs >= 1e-2. Sharded
# decode steps against the unsharded forward (recurrent KDA step, absorbed MLA) measure ~2e-6 too.
LOGITS_REL_RMS = 1e-5

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8 on CPU)")


# ---- mesh strings ------------------------------------------------------------------------------


def test_mesh_spec_sizes():
    sizes = parse_mesh_spec("data=2,expert=2,tensor=2", 8)
    assert sizes == {"data": 2, "fsdp": 1, "context": 1, "expert": 2, "tensor": 2}
    assert parse_mesh_spec(" expert = -1 , tensor=2 ", 8)["expert"] == 4
    assert parse_mesh_spec("context=8", 8)["context"] == 8


def test_make_mesh_has_all_axes_on_all_devices():
    mesh = make_mesh("fsdp=2,expert=-1")
    assert mesh.axis_names == ("data", "fsdp", "context", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 1, "expert": 4, "tensor": 1}
    assert mesh.devices.size == jax.device_count()
    assert dict(make_mesh(None).shape)["fsdp"] == jax.device_count()
    assert make_mesh(mesh) is mesh


@pytest.mark.parametrize(
    "spec, message",
    [
        ("model=8", "unknown axis 'model'"),
        ("expert=4", "multiply to 4, but there are 8 devices"),
        ("expert=2,tensor=2,data=4", "multiply to 16"),
        ("tensor=3,expert=-1", "fixed axes use 3 devices"),
        ("expert=-1,tensor=-1", "only one axis may be -1"),
        ("expert=2,expert=4", "'expert' is given twice"),
        ("tensor=two", "size 'two' of axis 'tensor'"),
        ("tensor=0", "axis 'tensor' has size 0"),
        ("tensor", "part 'tensor' is not of the form axis=size"),
    ],
)
def test_bad_mesh_specs_name_the_bad_part(spec, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(spec)


def test_mesh_device_count_of_explicit_specs():
    assert mesh_device_count("expert=8,tensor=4") == 32
    assert mesh_device_count(" data = 2 ") == 2
    with pytest.raises(ValueError, match=r"mesh spec 'expert=-1,tensor=2': axis 'expert' has size -1"):
        mesh_device_count("expert=-1,tensor=2")
    for spec, message in [("tensor=0", "axis 'tensor' has size 0"), ("tensor=two", "size 'two' of axis 'tensor'"),
                          ("model=2", "unknown axis 'model'")]:
        with pytest.raises(ValueError, match=rf"mesh spec '{spec}': .*{message}"):
            mesh_device_count(spec)


# ---- the rule table ----------------------------------------------------------------------------


def test_two_logical_axes_on_one_mesh_axis_is_an_error():
    rules = {**DEFAULT_RULES, "embed_moe": "fsdp"}  # routed_expert_down_proj is ("embed_moe", "embed")
    with pytest.raises(ValueError, match="'embed_moe' and 'embed'.*mesh axis 'fsdp'"):
        logical_to_spec(("embed_moe", "embed"), rules, make_mesh("fsdp=8"))
    with pytest.raises(KeyError, match="'heads' has no entry"):
        logical_to_spec(("heads",), DEFAULT_RULES, make_mesh("fsdp=8"))


def test_size_one_and_non_dividing_mesh_axes_are_dropped():
    mesh = make_mesh("data=2,fsdp=4")
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES, mesh) == P(None, "fsdp")  # tensor has size 1
    assert logical_to_spec(("activation_batch", None), DEFAULT_RULES, mesh, (8, 5)) == P(("data", "fsdp"))
    assert logical_to_spec(("activation_batch", None), DEFAULT_RULES, mesh, (2, 5)) == P("data")  # longest prefix
    assert logical_to_spec(("activation_batch", None), DEFAULT_RULES, mesh, (1, 5)) == P()
    assert logical_to_spec(("kda_heads",), DEFAULT_RULES, make_mesh("tensor=8"), (4,)) == P()  # 4 heads, 8 shards


# ---- the golden model on three meshes ----------------------------------------------------------


@pytest.fixture(scope="module")
def prompt():
    return jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)


@pytest.fixture(scope="module")
def unsharded(golden_model_fp32, prompt):
    logits = np.asarray(golden_model_fp32(prompt))
    tokens = np.asarray(k3jax.generate(golden_model_fp32, prompt, max_new_tokens=NEW_TOKENS))
    return logits, tokens


@pytest.fixture(scope="module", params=MESHES)
def sharded(request, golden_model_fp32):
    mesh = make_mesh(request.param)
    return mesh, shard_model(golden_model_fp32, mesh)


def test_parameters_are_split(sharded):
    mesh, model = sharded
    leaves = jax.tree.leaves(model)
    assert all(leaf.sharding.mesh == mesh for leaf in leaves)
    split = [leaf for leaf in leaves if leaf.sharding.shard_shape(leaf.shape) != leaf.shape]
    assert split, "every parameter is replicated"
    # The routed experts are split on `expert` in every mesh; the scanned groups' stacked axis never is.
    assert model.tail_layers[0].block_sparse_moe.experts.w1.sharding.spec[0] == "expert"
    assert model.group_layers[0].block_sparse_moe.experts.w1.sharding.spec[:2] == (None, "expert")


def test_logits_match_unsharded(sharded, prompt, unsharded):
    mesh, model = sharded
    logits = model(shard_batch(prompt, mesh))
    assert logits.sharding.device_set == set(mesh.devices.flat)  # ran partitioned over the whole mesh
    assert rel_rms(logits, unsharded[0]) <= LOGITS_REL_RMS


def test_greedy_generation_matches_unsharded(sharded, prompt, unsharded):
    mesh, model = sharded
    tokens = k3jax.generate(model, shard_batch(prompt, mesh), max_new_tokens=NEW_TOKENS)
    assert tokens.sharding.device_set == set(mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(tokens), unsharded[1])


# ---- caches and from_pretrained ----------------------------------------------------------------


def test_cache_shardings_split_batch_and_kda_heads(golden_model_fp32):
    mesh = make_mesh("data=2,expert=2,tensor=2")
    cache = jax.eval_shape(lambda: golden_model_fp32.empty_cache(2, 24))
    shardings = cache_shardings(cache, mesh)
    by_kind = lambda entries, kind: [e for e in entries if isinstance(e, kind)]  # noqa: E731
    for kda in by_kind(shardings.head + shardings.tail, KDACache):  # batch 2 on data, 4 heads on tensor
        assert kda.state.spec == P("data", "tensor") and kda.conv.spec == P("data", None, "tensor")
    for mla in by_kind(shardings.head + shardings.tail, MLACache):
        assert mla.latent.spec == P("data")
    # Group caches carry the stacked layer axis in front, never split.
    assert {kda.state.spec for kda in by_kind(shardings.groups, KDACache)} == {P(None, "data", "tensor")}
    assert {mla.latent.spec for mla in by_kind(shardings.groups, MLACache)} == {P(None, "data")}
    assert shardings.length.spec == P()


def test_cache_shardings_need_declared_axes():
    """A NamedTuple in a cache that declares no LOGICAL_AXES is an error naming it, not a guess."""

    class Undeclared(NamedTuple):
        state: jax.Array

    with pytest.raises(TypeError, match="Undeclared declares no LOGICAL_AXES"):
        cache_shardings((Undeclared(jnp.zeros((2, 4))),), make_mesh("data=2,expert=2,tensor=2"))


def test_decode_steps_keep_the_cache_layout(golden_model_fp32, prompt, unsharded):
    """Decode the first prompt tokens one by one from an empty sharded cache: each returned cache keeps
    cache_shardings' layout (so every step reuses one executable and its donated buffers), and the
    logits are the forward pass's at those positions (causal, so the rest of the prompt is irrelevant)."""
    mesh = make_mesh("data=2,expert=2,tensor=2")
    model = shard_model(golden_model_fp32, mesh)
    cache = shard_cache(model.empty_cache(prompt.shape[0], 4), mesh)
    for position in range(3):
        logits, cache = k3jax.decode_step(model, cache, shard_batch(prompt[:, position : position + 1], mesh)[:, 0])
        layout = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), cache, cache_shardings(cache, mesh))
        assert all(jax.tree.leaves(layout))
        assert rel_rms(logits, unsharded[0][:, position]) <= LOGITS_REL_RMS


def test_from_pretrained_with_a_mesh(golden_model_fp32):
    model = k3jax.from_pretrained(GOLDEN_DIR, dtype="float32", mesh="expert=4,tensor=2")
    expected = jax.tree.leaves(param_shardings(golden_model_fp32, model.embed_tokens.weight.sharding.mesh))
    assert [leaf.sharding for leaf in jax.tree.leaves(model)] == expected
    for leaf, want in zip(jax.tree.leaves(model), jax.tree.leaves(golden_model_fp32)):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))


def test_expert_meshes_run_moe_expert_parallel(golden_model_fp32):
    """shard_model hands the mesh to every MoE layer when experts are split (shard_map dispatch)."""
    sharded = shard_model(golden_model_fp32, make_mesh("expert=8"))
    assert sharded.layer(1).block_sparse_moe.expert_mesh is not None
    assert shard_model(golden_model_fp32, make_mesh("tensor=8")).layer(1).block_sparse_moe.expert_mesh is None
    assert golden_model_fp32.layer(1).block_sparse_moe.expert_mesh is None  # the input model is unchanged


def test_abstract_mesh_from_a_spec_without_devices():
    mesh = abstract_mesh("tensor=4, expert=8")
    assert mesh.size == 32 and dict(mesh.shape) == {"data": 1, "fsdp": 1, "context": 1, "expert": 8, "tensor": 4}
    assert dict(abstract_mesh("data=2,expert=-1", num_devices=16).shape)["expert"] == 8
    assert abstract_mesh("fsdp=-1").size == jax.device_count()
    for spec, message in [("pipeline=2", "unknown axis 'pipeline'"), ("expert=0", "size 0"),
                          ("expert=two", "not an integer"), ("expert", "axis=size")]:
        with pytest.raises(ValueError, match=message):
            abstract_mesh(spec)
