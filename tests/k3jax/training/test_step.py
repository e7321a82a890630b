"""The training step: full fine-tuning learns, a restored state resumes exactly, gradient accumulation
and the 8-device sharded step equal the plain step, bad configs and batches name their field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from k3jax.training import TrainConfig, Trainer
from sharding.mesh import make_mesh
from tests.k3jax.training.small_k3 import random_batch, small_model


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_trees_close(a, b, rtol, atol, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def test_full_finetune_learns_and_resumes_exactly():
    config = TrainConfig(learning_rate=3e-3, warmup_steps=2, total_steps=50, schedule="cosine", weight_decay=0.01,
                         z_loss=1e-4, remat="nothing_saveable", quantile_balancing=True)
    trainer = Trainer(small_model(), config)
    batch = random_batch(2, 32)
    first = trainer.step(batch)
    assert first["lr"] == 0.0 and first["tokens"] == 64.0  # warmup starts at 0
    snapshot = _host(trainer.state())
    later = [trainer.step(batch) for _ in range(3)]
    assert int(trainer.state()["step"]) == 4
    losses = [first["loss"]] + [m["loss"] for m in later]
    assert losses[-1] < 0.5 * losses[0], f"loss should halve within a few steps: {losses}"
    assert all(np.isfinite(m["grad_norm"]) and m["max_load_ratio"] >= 1.0 for m in later)
    final = _host(trainer.state())

    trainer.restore(snapshot)
    again = [trainer.step(batch) for _ in range(3)]
    assert [m["loss"] for m in again] == [m["loss"] for m in later]
    _assert_trees_close(_host(trainer.state()), final, 0, 0, "resumed state")


@pytest.fixture(scope="module")
def plain_trainer() -> Trainer:
    """The unsharded one-batch trainer both gradient comparisons below measure against. `gradients` updates
    nothing, so the tests share it, and with batches of one shape its gradient program compiles once."""
    return Trainer(small_model(), TrainConfig())


def _packed_batch(seed: int):
    """4 rows of 32 tokens, each row packing two documents (20 + 12 tokens)."""
    seg = np.repeat([[1] * 20 + [2] * 12], 4, axis=0).astype(np.int32)
    return random_batch(4, 32, seed=seed, segments=seg)


def test_grad_accumulation_equals_one_batch(plain_trainer):
    batch = _packed_batch(seed=3)
    batch = batch._replace(loss_mask=batch.loss_mask.at[0, :10].set(0.0))  # unequal token counts per micro-batch
    loss1, g1 = plain_trainer.gradients(batch)
    loss2, g2 = Trainer(small_model(), TrainConfig(grad_accum_steps=2)).gradients(batch)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g1))
    _assert_trees_close(g2, g1, 1e-5, 1e-5 * scale, "gradient")


def test_sharded_step_equals_unsharded(plain_trainer):
    """data=2, expert=2 (routed experts under shard_map), tensor=2 on 8 fake CPU devices; packed rows."""
    batch = _packed_batch(seed=5)
    loss, grads = plain_trainer.gradients(batch)
    sharded = Trainer(small_model(), TrainConfig(), mesh=make_mesh("data=2,expert=2,tensor=2"))
    loss_s, grads_s = sharded.gradients(batch)
    np.testing.assert_allclose(loss_s, loss, rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    _assert_trees_close(grads_s, grads, 1e-5, 1e-5 * scale, "sharded gradient")
    assert any(len(g.sharding.device_set) == 8 and not g.sharding.is_fully_replicated for g in jax.tree.leaves(grads_s))


@pytest.mark.parametrize("field, value, match", [
    ("optimizer", "sgd", "optimizer"), ("schedule", "step", "schedule"), ("learning_rate", 0.0, "learning_rate"),
    ("warmup_steps", 2000, "warmup_steps"), ("grad_accum_steps", 0, "grad_accum_steps"),
    ("remat", "save_only_these_names", "remat"), ("lora_rank", -1, "lora_rank"), ("lora_dropout", 1.0, "lora_dropout"),
    ("lora_targets", ["*q_proj"], "lora_targets"), ("b2", 1.5, "b2"), ("vocab_chunk", 0, "vocab_chunk"),
    ("quantile_balancing", 1, "quantile_balancing"),
])
def test_bad_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"TrainConfig.{match}"):
        TrainConfig(**{field: value})


def test_bad_batches_and_patterns():
    model = small_model()
    trainer = Trainer(model, TrainConfig(grad_accum_steps=2))
    good = random_batch(2, 8)
    for bad, match in [
        (good._replace(targets=good.targets[:, :4]), "batch.targets"),
        (good._replace(input_ids=good.input_ids.at[0, 0].set(512)), "batch.input_ids"),
        (good._replace(segment_ids=good.segment_ids.astype(jnp.float32)), "batch.segment_ids"),
        (random_batch(3, 8), "grad_accum_steps"),
    ]:
        with pytest.raises(ValueError, match=match):
            trainer.step(bad)
    with pytest.raises(TypeError, match="Batch"):
        trainer.step(tuple(good))
    with pytest.raises(ValueError, match="TrainConfig.freeze"):
        Trainer(model, TrainConfig(freeze=("*",)))
    with pytest.raises(ValueError, match="TrainConfig.lora_targets"):
        Trainer(model, TrainConfig(lora_rank=2, lora_targets=("nothing.*",)))
    with pytest.raises(ValueError, match="restore"):
        trainer.restore({"step": 0})


def test_state_saves_and_restores_with_orbax(tmp_path):
    """The whole state (Muon, LoRA with dropout keys, router biases) round-trips through Orbax as is."""
    trainer = Trainer(small_model(), TrainConfig(optimizer="muon", lora_rank=2, lora_dropout=0.1,
                                                 quantile_balancing=True))
    state = trainer.state()
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(0, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(0, args=ocp.args.StandardRestore(abstract))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    _assert_trees_close(restored, state, 0, 0, "orbax")
    trainer.restore(restored)
