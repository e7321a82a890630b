"""LoRA: adapters learn with the base frozen, merging equals the adapter forward, freezing by pattern,
and adapters train over packed MXFP4 experts (activation gradients through the frozen packed experts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.model import run_model
from k3jax.nn.moe import MXFP4Weight, PackedRoutedExperts, pack_routed_experts
from k3jax.training import LoRALinear, TrainConfig, Trainer, naive_cross_entropy
from pallas_kernels.mxfp4.codec import encode_mxfp4
from tests.k3jax.training.small_k3 import random_batch, small_model


def test_lora_learns_and_merge_equals_adapter_forward():
    model = small_model()
    config = TrainConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.05, learning_rate=1e-2, schedule="constant",
                         grad_clip_norm=0.0)
    trainer = Trainer(model, config)
    assert trainer.trainable_names and all(".lora_" in n for n in trainer.trainable_names)
    assert any("self_attn.q_proj" in n for n in trainer.lora_modules)  # KDA and MLA projections
    assert any("shared_experts.gate_proj" in n for n in trainer.lora_modules)
    batch = random_batch(2, 32, seed=1)
    losses = [trainer.step(batch)["loss"] for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0], f"LoRA loss should halve: {losses}"

    merged = trainer.merged_model()
    assert not any(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(merged))
    logits = jax.jit(lambda m, ids: run_model(m, ids)[0].logits)(merged, batch.input_ids)
    sums = naive_cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1),
                               batch.loss_mask.reshape(-1))
    np.testing.assert_allclose(float(sums.nll / sums.tokens), trainer.eval_loss(batch), rtol=1e-5)
    # Untargeted weights are the base model's, untouched.
    np.testing.assert_array_equal(np.asarray(merged.lm_head.weight[...]), np.asarray(model.lm_head.weight[...]))
    np.testing.assert_array_equal(np.asarray(merged.embed_tokens.weight[...]), np.asarray(model.embed_tokens.weight[...]))


def test_freeze_by_pattern():
    trainer = Trainer(small_model(), TrainConfig(freeze=("embed_tokens.*", "lm_head.*", "*.self_attn.*")))
    names = trainer.trainable_names
    assert names and not any(n.startswith(("embed_tokens", "lm_head")) or ".self_attn." in n for n in names)
    assert any(".block_sparse_moe.experts.w1" in n for n in names)


def _packed_model():
    """The small model with its routed experts MXFP4-packed (codes of the dense weights)."""
    model = small_model()
    dense = {path: np.asarray(m.experts.w1[...]) for path, m in nnx.iter_modules(model) if hasattr(m, "experts")}
    assert dense
    packed = {}
    for path, m in nnx.iter_modules(model):
        if hasattr(m, "experts"):
            packed[path] = {n: encode_mxfp4(np.asarray(getattr(m.experts, n)[...], np.float32)) for n in ("w1", "w2", "w3")}
    pack_routed_experts(model)
    for path, m in nnx.iter_modules(model):
        if isinstance(getattr(m, "experts", None), PackedRoutedExperts):
            for n, (codes, scales) in packed[path].items():
                axes = getattr(m.experts, n).packed.get_metadata()["logical_axes"]
                setattr(m.experts, n, MXFP4Weight(jnp.asarray(codes), jnp.asarray(scales), axes))
    return model


def test_lora_over_packed_mxfp4_experts():
    model = _packed_model()
    trainer = Trainer(model, TrainConfig(lora_rank=4, learning_rate=1e-2, schedule="constant"))
    assert not any(".experts." in n for n in trainer.trainable_names)
    batch = random_batch(2, 16, seed=2)
    loss, grads = trainer.gradients(batch)
    flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    # routed_expert_down_proj feeds only the routed experts: its adapter's gradient crossed them.
    down = [g for k, g in flat.items() if "routed_expert_down_proj" in k and "lora_b" in k]
    assert down and all(float(jnp.abs(g).max()) > 0 for g in down)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model)) if x.dtype == jnp.uint8]
    losses = [trainer.step(batch)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    merged = trainer.merged_model()
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(merged)) if x.dtype == jnp.uint8]
    assert len(before) == len(after) > 0
    for a, b in zip(before, after):  # still packed, bit for bit
        np.testing.assert_array_equal(a, b)
