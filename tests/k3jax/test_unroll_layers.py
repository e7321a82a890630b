"""`K3Model.unroll_layers`: the scanned groups' stacked weights split into per-layer arrays, in place.

The unrolled model runs the same per-layer computation, only outside `lax.scan`, so its fp32 logits
equal the scanned model's up to reduction order (1e-6 rel-RMS, far below the 1e-2 a wrong layer
order or a swapped weight costs) and match the official code's outputs at the golden tolerances.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from sharding import make_mesh, shard_batch, shard_model
from tests.conftest import GOLDEN_DIR, rel_rms

SAME_MATH_REL_RMS = 1e-6


@pytest.fixture(scope="module")
def unrolled():
    """A private golden model, unrolled, and weak references to the stacked arrays it had."""
    model = k3jax.from_pretrained(GOLDEN_DIR, dtype="float32")
    stacked = [weakref.ref(leaf) for leaf in jax.tree.leaves(model.group_layers)]
    assert stacked, "the golden model has no scanned groups: nothing would be tested"
    model.unroll_layers()
    return model, stacked


def test_every_layer_holds_its_own_arrays(unrolled, golden_model_fp32):
    model, stacked = unrolled
    cfg = model.config
    assert model.group_layers is None and model.plan.num_groups == 0 and len(model.tail_layers) == 0
    assert len(model.head_layers) == cfg.num_hidden_layers
    assert all(ref() is None for ref in stacked)  # dropped, not kept beside the per-layer copies
    for index in range(cfg.num_hidden_layers):  # each layer's weights where the scanned model had them
        ours, theirs = jax.tree.leaves(model.layer(index)), jax.tree.leaves(golden_model_fp32.layer(index))
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a, b)
    model.unroll_layers()  # a second call changes nothing
    assert len(model.head_layers) == cfg.num_hidden_layers


def test_logits_match_the_scanned_model_and_the_reference(unrolled, golden_model_fp32, golden_reference):
    model, _ = unrolled
    text = golden_reference("text_fp32")
    ids = jnp.asarray(text["input_ids"])
    logits = np.asarray(model(ids))
    assert rel_rms(logits, np.asarray(golden_model_fp32(ids))) <= SAME_MATH_REL_RMS
    assert rel_rms(logits, text["logits"]) <= 1e-4


def test_cached_generation_matches_the_reference(unrolled, golden_reference):
    model, _ = unrolled
    reference = golden_reference("generate_fp32")
    prompt, new_ids = jnp.asarray(reference["prompt_ids"]), reference["new_ids"]
    np.testing.assert_array_equal(np.asarray(k3jax.generate(model, prompt, max_new_tokens=new_ids.shape[1])), new_ids)
    logits, cache = k3jax.prefill(model, prompt, capacity=prompt.shape[1] + new_ids.shape[1])
    steps = [np.asarray(logits[0])]
    for token in new_ids[0, :-1]:
        step_logits, cache = k3jax.decode_step(model, cache, jnp.asarray([token]))
        steps.append(np.asarray(step_logits[0]))
    assert rel_rms(np.stack(steps), reference["step_logits"]) <= 1e-4


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8 on CPU)")
def test_sharded_model_keeps_its_shardings(golden_model_fp32):
    mesh = make_mesh("data=2,expert=2,tensor=2")
    model = shard_model(golden_model_fp32, mesh)  # may share buffers with the golden model: left intact
    first_scanned = model.plan.start
    stacked_spec = model.group_layers[0].block_sparse_moe.experts.w1.sharding.spec
    model.unroll_layers()
    w1 = model.layer(first_scanned).block_sparse_moe.experts.w1
    assert w1.sharding.mesh == mesh and tuple(w1.sharding.spec) == tuple(stacked_spec)[1:]
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)
    sharded_logits = model(shard_batch(prompt, mesh))
    assert rel_rms(sharded_logits, np.asarray(golden_model_fp32(prompt))) <= 1e-5  # tests/sharding's bound


def test_from_pretrained_layers_choice():
    assert k3jax.from_pretrained(GOLDEN_DIR, dtype="float32", layers="unrolled").plan.num_groups == 0
    assert k3jax.from_pretrained(GOLDEN_DIR, dtype="float32", layers="auto").plan.num_groups > 0  # CPU: scanned
    with pytest.raises(ValueError, match=r"layers='flat': expected one of \('scanned', 'unrolled', 'auto'\)"):
        k3jax.from_pretrained(GOLDEN_DIR, layers="flat")
