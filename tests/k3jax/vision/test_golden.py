"""The vision path against the official code's outputs (golden `multimodal_fp32.npz`), at fp32.

Tower output (after the 2x2 merge), projector output, the merged input embeddings and the final
logits must each lie within 1e-4 rel-RMS of the reference (the golden README's logits bound; CPU
lands near 1e-6 for the tower and ~4e-6 for the logits), loaded from the release directory, from a
converted (Orbax) directory, and sharded over 8 fake CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.convert import convert
from k3jax.model import embed_images
from k3jax.vision.embed import prepare_images
from tests.conftest import rel_rms

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ref(golden_reference):
    return golden_reference("multimodal_fp32")


def vision_outputs(model, ref) -> dict[str, np.ndarray]:
    """Tower, projector, merged embeddings and logits of the golden prompt."""
    ids, pixels, grid_thws = ref["input_ids"], ref["pixel_values"], ref["grid_thws"]
    grids = tuple(map(tuple, grid_thws.tolist()))
    tower = jax.jit(lambda m, x: m.vision_tower(x, grids))(model, jnp.asarray(pixels))
    features = jax.jit(lambda m, x: m.mm_projector(x))(model, tower)
    images, _ = prepare_images(model, jnp.asarray(ids), None, pixels, grid_thws)
    embeds = jax.jit(embed_images)(model, jnp.asarray(ids), images)
    logits = model(ids, pixel_values=pixels, grid_thws=grid_thws)
    return {"vision_tower_out": tower, "image_features": features, "inputs_embeds": embeds[0], "logits": logits}


def check(outputs: dict[str, np.ndarray], ref) -> None:
    for key, actual in outputs.items():
        assert actual.shape == ref[key].shape, key
        error = rel_rms(actual, ref[key])
        assert error < TOLERANCE, f"{key}: rel-RMS {error:.2e}"


def test_release_directory_matches_the_official_code(golden_model_fp32, ref):
    outputs = vision_outputs(golden_model_fp32, ref)
    check(outputs, ref)
    assert rel_rms(outputs["vision_tower_out"], ref["vision_tower_out"]) < 1e-5  # the tower alone is tighter


def test_converted_directory_matches_the_official_code(tmp_path, golden_dir, ref):
    out = tmp_path / "fp32"
    convert(golden_dir, out, dtype="float32", progress=False)
    model = k3jax.from_pretrained(out, dtype="float32")
    assert model.vision_tower is not None
    check(vision_outputs(model, ref), ref)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (jax_num_cpu_devices=8 on CPU)")
def test_sharded_over_eight_devices_matches_the_official_code(golden_dir, ref):
    model = k3jax.from_pretrained(golden_dir, dtype="float32", mesh="fsdp=2,expert=2,tensor=2")
    fc0 = model.vision_tower.encoder.blocks[0].mlp.fc0.weight[...]
    proj = model.mm_projector.proj[2].weight[...]
    assert fc0.sharding.spec[0] == "tensor" and tuple(proj.sharding.spec) == ("fsdp", "tensor")  # really split
    check(vision_outputs(model, ref), ref)
