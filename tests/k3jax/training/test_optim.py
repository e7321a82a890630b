"""Optimizer groups: every parameter lands in its group; Muon orthogonalises per head and per expert;
weight decay only where specified."""

from __future__ import annotations

import fnmatch
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.training import GROUPS, TrainConfig, labels, make_optimizer
from k3jax.training.optim import path_name
from tests.k3jax.training.small_k3 import small_config, small_model

EXPECTED = [  # (pattern over parameter names, group), first match wins
    ("*A_log", "kda_gate"), ("*dt_bias", "kda_gate"),
    ("*norm.weight", "no_decay"), ("*norm[01].weight", "no_decay"), ("*res_proj.weight", "no_decay"),
    ("*.bias", "no_decay"),
    ("vision_tower.*", "adamw"), ("mm_projector.*", "adamw"),
    ("embed_tokens.weight", "adamw"), ("lm_head.weight", "adamw"), ("*conv1d.weight", "adamw"),
    ("*self_attn.*_proj*.weight", "muon"), ("*experts.w[123]", "muon"), ("*gate.weight", "muon"),
    ("*_proj.weight", "muon"),
]


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(lambda x: x.astype(jnp.float32), nnx.to_pure_dict(nnx.state(small_model(), nnx.Param)))


def test_every_parameter_has_its_group(params):
    got = {path_name(p): g for p, g in jax.tree_util.tree_leaves_with_path(labels(params))}
    assert got and set(got.values()) == set(GROUPS)
    for name, group in got.items():
        want = next((g for pattern, g in EXPECTED if fnmatch.fnmatchcase(name, pattern)), None)
        assert want == group, f"{name}: group {group}, expected {want}"
    assert not any("e_score_correction_bias" in name for name in got)  # state, not a parameter


@functools.lru_cache(maxsize=None)
def _optimizer(**config):
    tx = make_optimizer(TrainConfig(**config), small_config())
    return tx, jax.jit(tx.update)


def _update(params, grads, **config):
    tx, update = _optimizer(**config)
    return update(grads, tx.init(params), params)[0]


def test_weight_decay_only_where_specified(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    for optimizer in ("adamw", "muon"):
        updates = _update(params, zeros, optimizer=optimizer, learning_rate=0.1, weight_decay=0.5,
                          schedule="constant", grad_clip_norm=0.0)
        for (path, u), group, p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(labels(params)),
                                       jax.tree.leaves(params)):
            moved = float(jnp.abs(u).max())
            if group in ("no_decay", "kda_gate"):
                assert moved == 0.0, f"{optimizer}: {path_name(path)} ({group}) decayed"
            else:
                np.testing.assert_allclose(np.asarray(u), -0.1 * 0.5 * np.asarray(p), rtol=1e-5, atol=1e-8,
                                           err_msg=f"{optimizer}: {path_name(path)} ({group})")


def _block_independent(params, name: str, block0: tuple, view, blocks: int) -> None:
    """Perturbing block 0 (index `block0`) of `name`'s gradient changes Muon's update of that block only;
    `view` splits the update into its blocks."""
    grads = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(0).normal(size=p.shape), jnp.float32), params)
    kwargs = dict(optimizer="muon", learning_rate=0.1, schedule="constant", grad_clip_norm=0.0)
    base = _update(params, grads, **kwargs)
    perturb = lambda path, g: g.at[block0].multiply(3.0).at[block0].add(0.5) if path_name(path) == name else g  # noqa: E731
    changed = _update(params, jax.tree_util.tree_map_with_path(perturb, grads), **kwargs)
    pick = lambda tree: view(next(u for p, u in jax.tree_util.tree_leaves_with_path(tree) if path_name(p) == name))  # noqa: E731
    a, b = np.asarray(pick(base)), np.asarray(pick(changed))
    assert a.shape[0] == blocks
    assert np.abs(a[0] - b[0]).max() > 1e-4, f"{name}: block 0 should change"
    np.testing.assert_allclose(a[1:], b[1:], rtol=1e-6, atol=1e-7, err_msg=f"{name}: other blocks changed")


def test_muon_is_per_head_and_per_expert(params):
    cfg = small_config()
    h, hd = cfg.kda_num_heads, cfg.kda_head_dim
    kda = "head_layers.0.self_attn.q_proj.weight"  # [H * hd, D]
    _block_independent(params, kda, np.s_[:hd], lambda w: w.reshape(h, hd, -1), h)
    mla = "group_layers.1.self_attn.kv_b_proj.weight"  # [G, H * (nope + v), kv_lora]; layer group 0
    per = cfg.qk_nope_head_dim + cfg.v_head_dim
    _block_independent(params, mla, np.s_[0, :per], lambda w: w[0].reshape(cfg.mla_num_heads, per, -1), cfg.mla_num_heads)
    experts = "group_layers.0.block_sparse_moe.experts.w1"  # [G, E, F, latent]; layer group 0
    _block_independent(params, experts, np.s_[0, 0], lambda w: w[0], cfg.num_experts)
