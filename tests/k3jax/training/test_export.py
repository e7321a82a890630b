"""Export to the release layout: the golden model written back has the release's tensor names and loads to
the same logits (MXFP4 experts byte for byte); a LoRA run exports its merged model with the experts still
MXFP4, and that model fits the training data better than the base."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import k3jax
from k3jax.checkpoint.release_writer import write_model_release
from k3jax.checkpoint.safetensors_index import CheckpointIndex
from k3jax.training.run import finetune
from tests.conftest import GOLDEN_DIR
from tests.k3jax.training.finetune_helpers import BATCH, SEQ_LEN, data_loss, write_data

IDS = (np.arange(24, dtype=np.int32)[None] * 37) % 512


def _text_names(root) -> set[str]:
    return {n for n in CheckpointIndex.open(root).names() if n.startswith("language_model.")}


def _tensors(root) -> dict[str, np.ndarray]:
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    found = {}
    for file in sorted(set(index.values())):
        found.update(load_file(str(root / file)))
    return found


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_golden_written_back_is_the_release(tmp_path, golden_model_fp32, experts):
    model = golden_model_fp32 if experts == "bf16" else k3jax.from_pretrained(GOLDEN_DIR, dtype="float32",
                                                                            experts="mxfp4")
    config = json.loads((GOLDEN_DIR / "config.json").read_text())
    out = write_model_release(tmp_path / "out", config, model, pack_experts=True)
    assert _text_names(out) == _text_names(GOLDEN_DIR)  # the release's names, MXFP4 pairs per expert
    golden = _tensors(GOLDEN_DIR)
    written = _tensors(out)
    for name, array in written.items():  # bf16 weights, fp32 A_log (padded) and router bias, uint8 MXFP4
        assert array.dtype == golden[name].dtype and array.shape == golden[name].shape, name
        if experts == "mxfp4" or "experts." not in name:
            np.testing.assert_array_equal(array, golden[name], err_msg=name)
    reloaded = k3jax.from_pretrained(out, dtype="float32")
    np.testing.assert_array_equal(np.asarray(reloaded(IDS)), np.asarray(golden_model_fp32(IDS)))


def test_dense_experts_export_as_weight_tensors(tmp_path, golden_model_fp32):
    config = json.loads((GOLDEN_DIR / "config.json").read_text())
    out = write_model_release(tmp_path / "out", config, golden_model_fp32, pack_experts=False)
    names = _text_names(out)
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert not any(n.endswith(".weight_packed") for n in names)
    np.testing.assert_array_equal(np.asarray(k3jax.from_pretrained(out, dtype="float32")(IDS)),
                                  np.asarray(golden_model_fp32(IDS)))


def test_lora_run_exports_merged_model_with_packed_experts(tmp_path, golden_model_fp32):
    # Data order seed 1: its 3 batches hold one document per row, so the run compiles one train step.
    data = write_data(tmp_path / "data.jsonl")
    result = finetune(GOLDEN_DIR, data, tmp_path / "out", steps=3, batch_size=BATCH, seq_len=SEQ_LEN,
                      learning_rate=1e-2, lora_rank=4, lora_alpha=8.0, seed=1, progress=False)
    golden, exported = _tensors(GOLDEN_DIR), _tensors(result.final)
    experts = [n for n in exported if ".experts." in n]
    assert experts and all(n.endswith((".weight_packed", ".weight_scale")) for n in experts)
    for name in experts:  # frozen under LoRA: the release's own bytes
        np.testing.assert_array_equal(exported[name], golden[name], err_msg=name)
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(exported[q], golden[q])  # the adapter merged into its base weight
    tuned = k3jax.from_pretrained(result.final, dtype="float32")
    base, after = data_loss(golden_model_fp32, data), data_loss(tuned, data)
    assert after < base - 0.1, (base, after)
