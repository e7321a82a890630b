"""`--experts mxfp4`: routed experts stay MXFP4-packed on disk and in the model, decoded on the fly.

The packed model must compute exactly what the model with decoded experts computes (bit for bit in
fp32: the decode is exact and happens right before the same GEMMs), and the stored bytes must be the
release's own, so that decoding them with ml_dtypes gives the release's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import CheckpointError, CheckpointIndex
from pallas_kernels.mxfp4 import decode_mxfp4_jax, encode_mxfp4
from k3jax.checkpoint.store import ItemStore
from k3jax.convert import convert
from k3jax.nn.moe import MXFP4Weight, PackedRoutedExperts
from pallas_kernels.moe import MXFP4Experts, routed_experts

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 8)), jnp.int32)


def _ml_dtypes_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The oracle: nibbles -> float4_e2m1fn, bytes -> float8_e8m0fnu, both decoded by ml_dtypes."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    factor = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return (values.reshape(*scale.shape, 32) * factor[..., None]).reshape(values.shape)


@pytest.fixture(scope="module")
def packed_fp32(golden_dir):
    return k3jax.from_pretrained(golden_dir, dtype="float32", experts="mxfp4")


def test_packed_model_logits_equal_the_decoded_model_bit_for_bit(packed_fp32, golden_model_fp32):
    experts = packed_fp32.group_layers[0].block_sparse_moe.experts
    assert isinstance(experts, PackedRoutedExperts) and isinstance(experts.w1, MXFP4Weight)
    assert experts.w1.packed[...].dtype == jnp.uint8 and experts.w1.packed[...].shape == (2, 16, 64, 32)
    assert experts.w1.scale[...].shape == (2, 16, 64, 2) and experts.w1.shape == (2, 16, 64, 64)
    np.testing.assert_array_equal(np.asarray(packed_fp32(IDS)), np.asarray(golden_model_fp32(IDS)))


def test_packed_leaves_are_the_release_bytes_and_decode_like_ml_dtypes(converted_fp32, golden_dir, golden_model_fp32):
    index = CheckpointIndex.open(golden_dir)
    leaves = ItemStore(converted_fp32).restore("layer_003")
    base = "language_model.model.layers.3.block_sparse_moe.experts.{}.w2.weight_"
    packed, scale = leaves["block_sparse_moe.experts.w2.packed"], leaves["block_sparse_moe.experts.w2.scale"]
    np.testing.assert_array_equal(packed, np.stack([index.read(base.format(e) + "packed") for e in range(16)]))
    np.testing.assert_array_equal(scale, np.stack([index.read(base.format(e) + "scale") for e in range(16)]))
    decoded = np.asarray(decode_mxfp4_jax(packed, scale))
    np.testing.assert_array_equal(decoded, _ml_dtypes_decode(packed, scale))
    np.testing.assert_array_equal(decoded, np.asarray(golden_model_fp32.layer(3).block_sparse_moe.experts.w2[...]))


@pytest.mark.parametrize("implementation", ["xla", "dense"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routed_experts_decode_packed_weights_exactly(implementation, dtype):
    rng = np.random.default_rng(1)
    e, inter, latent, n, k = 4, 64, 32, 8, 2
    dense = {name: 0.1 * rng.standard_normal(shape, np.float32) for name, shape in
             {"w1": (e, inter, latent), "w3": (e, inter, latent), "w2": (e, latent, inter)}.items()}
    packed = {name: MXFP4Experts(*map(jnp.asarray, encode_mxfp4(w))) for name, w in dense.items()}
    decoded = {name: p.decode(dtype) for name, p in packed.items()}
    x = jnp.asarray(rng.standard_normal((n, latent)), dtype)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
    run = lambda w: routed_experts(x, w["w1"], w["w2"], w["w3"], weights, ids, beta=4.0, linear_beta=25.0,  # noqa: E731
                                   implementation=implementation)
    np.testing.assert_array_equal(np.asarray(jax.jit(run)(packed)), np.asarray(run(decoded)))


def test_experts_option_of_a_converted_directory(tmp_path, golden_dir, converted_fp32, golden_model_fp32):
    decoded = k3jax.from_pretrained(converted_fp32, dtype="float32", experts="bf16")
    assert decoded.group_layers[0].block_sparse_moe.experts.w1[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(decoded(IDS)), np.asarray(golden_model_fp32(IDS)))

    convert(golden_dir, tmp_path / "dense", experts="bf16", progress=False)
    with pytest.raises(CheckpointError, match="stores decoded routed experts.*--experts mxfp4"):
        k3jax.from_pretrained(tmp_path / "dense", experts="mxfp4")
    with pytest.raises(ValueError, match="experts='fp4'"):
        k3jax.from_pretrained(converted_fp32, experts="fp4")
