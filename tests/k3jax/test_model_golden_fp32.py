"""The model against outputs of Moonshot's own modeling code on k3-tiny-a, in fp32.

Tolerances (golden README §6): the reference's own fp32 noise (batch composition, matmul shapes in
the MoE dispatch) moves logits by ~1e-5 and grows ~10x from embeddings to logits, so a correct
fp32 implementation lands below 1e-4 rel-RMS / 1e-3 max-abs on the logits, and ~1e-6..1e-5 per
layer with teacher forcing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax.nn.attn_res import AttnResStream, attn_res_mix
from tests.conftest import rel_rms

LAYER_TOL = 1e-5


@pytest.fixture(scope="module")
def text(golden_reference):
    return golden_reference("text_fp32")


@pytest.fixture(scope="module")
def full_forward(golden_model_fp32, text):
    return k3jax.forward(golden_model_fp32, jnp.asarray(text["input_ids"]), collect_taps=True)


def test_logits_match_reference(full_forward, text):
    logits, expected = np.asarray(full_forward.logits), text["logits"]
    assert logits.dtype == np.float32 and logits.shape == expected.shape
    assert rel_rms(logits, expected) <= 1e-4
    assert np.abs(logits - expected).max() <= 1e-3
    assert np.array_equal(logits.argmax(-1), expected.argmax(-1))


def test_final_hidden_and_output_attn_res(full_forward, text):
    assert rel_rms(full_forward.final_attn_res, text["final_attnres_out"]) <= 1e-4
    assert rel_rms(full_forward.final_hidden, text["final_hidden"]) <= 1e-4


def test_model_call_returns_fp32_logits(golden_model_fp32, text):
    logits = golden_model_fp32(jnp.asarray(text["input_ids"][:1, :40]))
    assert logits.dtype == jnp.float32 and logits.shape == (1, 40, 512)
    assert rel_rms(logits, text["logits"][:1, :40]) <= 1e-4


def test_router_choices_match_in_full_forward(full_forward, text):
    for row, layer in enumerate(text["moe_layers"]):
        ids = np.sort(np.asarray(full_forward.taps[layer].router_ids), axis=-1)
        np.testing.assert_array_equal(ids, text["router_topk"][row], err_msg=f"layer {layer}")


@pytest.fixture(scope="module")
def taps(golden_reference):
    return golden_reference("layers_seq0_fp32")


def _sublayer_outputs(model, i: int, taps) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Teacher forcing: run layer i's mixer and FFN on the reference's own inputs."""
    layer = model.layer(i)
    attn_in = jnp.asarray(taps[f"layer{i}_attn_in"])[None]
    mlp_in = jnp.asarray(taps[f"layer{i}_mlp_in"])[None]
    attn_out, _ = layer.self_attn(layer.input_layernorm(attn_in))
    if layer.ffn_kind == "dense":
        return np.asarray(attn_out[0]), np.asarray(layer.mlp(layer.post_attention_layernorm(mlp_in))[0]), None
    mlp_out, ids = layer.block_sparse_moe(layer.post_attention_layernorm(mlp_in))
    return np.asarray(attn_out[0]), np.asarray(mlp_out[0]), np.asarray(ids[0])


@pytest.mark.parametrize("i", range(13))
def test_layer_outputs_with_teacher_forcing(golden_model_fp32, taps, text, i):
    attn_out, mlp_out, router_ids = _sublayer_outputs(golden_model_fp32, i, taps)
    assert rel_rms(attn_out, taps[f"layer{i}_attn_out"]) <= LAYER_TOL
    assert rel_rms(mlp_out, taps[f"layer{i}_mlp_out"]) <= LAYER_TOL
    if router_ids is not None:
        row = list(text["moe_layers"]).index(i)
        np.testing.assert_array_equal(np.sort(router_ids, -1), text["router_topk"][row, 0])


def test_attn_res_mixes_with_teacher_forcing(golden_model_fp32, taps):
    """Rebuild every AttnRes source from the taps and check each site's mix against the reference.

    Sources: the embeddings (= layer 0's attn_in), then per-block sums of attn_out + mlp_out.
    """
    model, cfg = golden_model_fp32, golden_model_fp32.config
    tap = lambda name: jnp.asarray(taps[name])[None]  # noqa: E731
    stream = AttnResStream.start(tap("layer0_attn_in"), cfg.num_attn_res_blocks)
    for i in range(cfg.num_hidden_layers):
        layer = model.layer(i)
        mix = attn_res_mix(stream, layer.self_attention_res_proj.weight[...][0], layer.self_attention_res_norm.weight[...], cfg.rms_norm_eps)
        assert rel_rms(mix, taps[f"layer{i}_attn_in"][None]) <= LAYER_TOL, f"layer {i} pre-mixer"
        stream = stream.push_block_if(i % cfg.attn_res_block_size == 0).add(tap(f"layer{i}_attn_out"))
        mix = attn_res_mix(stream, layer.mlp_res_proj.weight[...][0], layer.mlp_res_norm.weight[...], cfg.rms_norm_eps)
        assert rel_rms(mix, taps[f"layer{i}_mlp_in"][None]) <= LAYER_TOL, f"layer {i} pre-FFN"
        stream = stream.add(tap(f"layer{i}_mlp_out"))


def test_full_forward_taps_track_reference(full_forward, taps):
    """Without teacher forcing, errors compound but stay at the fp32-noise level through depth."""
    for i, tap in enumerate(full_forward.taps):
        for name in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
            assert rel_rms(np.asarray(getattr(tap, name))[0], taps[f"layer{i}_{name}"]) <= 1e-4, (i, name)
