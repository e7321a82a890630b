"""Optimizer groups and the optax transformation of a fine-tuning run.

Groups, by parameter path (`param_group`):
  "muon"      matrices of the projections and experts (optimizer "muon": `optax.contrib.muon`,
              Newton-Schulz per attention head for KDA q/k/v and MLA q_b/kv_b, per expert for stacked
              routed experts; optimizer "adamw": AdamW with weight decay)
  "adamw"     embeddings, lm_head, the KDA short-conv kernels, LoRA adapters: AdamW with weight decay
  "no_decay"  norms, gate vectors (KDA o_norm) and the AttnRes pseudo-queries: AdamW, no decay
  "kda_gate"  KDA `A_log` and `dt_bias`: their own AdamW group, no decay
Muon uses `consistent_rms=0.2` (Moonlight/K2's 0.2 * sqrt(max(fan_in, fan_out)), fans per head or
expert block), so one learning rate serves both Muon and AdamW groups. Per-head orthogonalisation
needs [H * hd, in] weights viewed as [H, hd, in], which Muon's dimension numbers cannot express
(they merge axes, never split them): `per_head_view` reshapes those leaves around the optimizer, so
their Muon state lives in the head view.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from k3jax.config import K3Config
from k3jax.training.config import TrainConfig

GROUPS = ("muon", "adamw", "no_decay", "kda_gate")
_NO_DECAY = re.compile(r"(res_proj\.weight|norm\.weight)$")
# The vision tower and projector stay with AdamW: Muon's orthogonalised updates are set up (per head,
# per expert) for the decoder's matrices only.
_ADAMW_MATRICES = re.compile(r"(embed_tokens\.weight|lm_head\.weight|conv1d\.weight|lora_[ab])$|^(vision_tower|mm_projector)\.")
_PER_HEAD_KDA = re.compile(r"self_attn\.(q_proj|k_proj|v_proj)\.weight$")
_PER_HEAD_MLA = re.compile(r"self_attn\.(q_b_proj|kv_b_proj)\.weight$")


def path_name(path: tuple) -> str:
    """Dotted name of a state path, e.g. 'head_layers.1.self_attn.q_proj.weight'."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_group(name: str, ndim: int) -> str:
    """The group of the parameter `name` (dotted path) with `ndim` dims (stacked layer axes excluded)."""
    if name.endswith(("A_log", "dt_bias")):
        return "kda_gate"
    if ndim < 2 or _NO_DECAY.search(name):
        return "no_decay"
    if _ADAMW_MATRICES.search(name):
        return "adamw"
    return "muon"


def head_count(name: str, cfg: K3Config) -> int | None:
    """Heads to orthogonalise separately for a per-head Muon weight, else None."""
    if _PER_HEAD_KDA.search(name) and "lora" not in name:
        return cfg.kda_num_heads
    if _PER_HEAD_MLA.search(name):
        return cfg.mla_num_heads
    return None


def unstacked_ndim(name: str, ndim: int) -> int:
    """Dims of one layer's parameter: scanned groups carry one leading layer axis."""
    return ndim - 1 if name.startswith("group_layers.") else ndim


def labels(params: object) -> object:
    """The group of every leaf of a parameter tree (same structure, string leaves)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: param_group(path_name(path), unstacked_ndim(path_name(path), x.ndim)), params
    )


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then cosine or linear decay to 0 at `total_steps`, or constant."""
    lr, warm, total = config.learning_rate, config.warmup_steps, config.total_steps
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warm, total, end_value=0.0)
    after = optax.constant_schedule(lr) if config.schedule == "constant" else optax.linear_schedule(lr, 0.0, total - warm)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm])


def per_head_view(inner: optax.GradientTransformation, heads: Callable[[str], int | None]) -> optax.GradientTransformation:
    """`inner` on a view where each leaf with `heads(name)` = H is reshaped [..., H * hd, in] -> [..., H, hd, in]."""

    def view(tree, inverse_of=None):
        def one(path, x):
            h = heads(path_name(path))
            if h is None:
                return x
            if inverse_of is not None:
                return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])
            return x.reshape(*x.shape[:-2], h, x.shape[-2] // h, x.shape[-1])

        return jax.tree_util.tree_map_with_path(one, tree)

    def init(params):
        return inner.init(view(params))

    def update(updates, state, params=None):
        out, state = inner.update(view(updates), state, None if params is None else view(params))
        return view(out, inverse_of=True), state

    return optax.GradientTransformation(init, update)


def make_optimizer(config: TrainConfig, model_config: K3Config) -> optax.GradientTransformation:
    """Clip by global norm (if set), then each group's transformation, all on the schedule."""
    lr = learning_rate_schedule(config)
    adamw = lambda wd: optax.adamw(lr, b1=config.b1, b2=config.b2, weight_decay=wd)  # noqa: E731
    if config.optimizer == "muon":
        muon = optax.contrib.muon(
            lr, weight_decay=config.weight_decay, consistent_rms=0.2, adam_learning_rate=lr,
            muon_weight_dimension_numbers=lambda p: jax.tree.map(lambda _: MuonDimensionNumbers(-1, -2), p),
        )
        matrices = per_head_view(muon, lambda name: head_count(name, model_config))
    else:
        matrices = adamw(config.weight_decay)
    transforms: Mapping[str, optax.GradientTransformation] = {
        "muon": matrices, "adamw": adamw(config.weight_decay), "no_decay": adamw(0.0), "kda_gate": adamw(0.0),
    }
    chain = [optax.multi_transform(transforms, labels)]
    if config.grad_clip_norm > 0:
        chain.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
    return optax.chain(*chain)
