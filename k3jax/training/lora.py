"""LoRA adapters on the model's projections, freezing by name, and folding adapters back in.

`LoRALinear` replaces a `Linear` in place: it keeps the base `weight` (same attribute, so checkpoint
names and shardings are unchanged) and adds `lora_a` [r, in] (uniform, bound in^-1/2) and `lora_b` [out, r]
(zeros, so step 0 is the base model) as `nnx.LoRAParam`s: y = W x + (alpha / r) B A dropout(x).
flax's `nnx.LoRA` is not used because it has no alpha / r scaling, lays A, B out [in, r] / [r, out]
against the release's [out, in] weights and has no notion of the stacked layer axis of scanned
groups (adapters here carry the base's leading axes, one adapter per layer). Dropout draws from a
per-module `LoRADropoutKey` state the trainer refreshes every step, so the forward stays a pure
function of the model. The routed experts (3-D stacks, packed MXFP4 in the release) get per-expert
adapters when a target pattern names their `experts` module (k3jax/training/expert_lora.py); the
default targets leave them frozen.
"""

from __future__ import annotations

import fnmatch

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.nn.layers import F32, Linear, linear
from k3jax.nn.moe import PackedRoutedExperts, RoutedExperts
from k3jax.training.config import LORA_TARGETABLE
from k3jax.training.expert_lora import LoRARoutedExperts
from k3jax.training.lora_dropout import LoRADropoutKey, lora_dropout


class LoRALinear(nnx.Module):
    def __init__(self, base: Linear, *, rank: int, alpha: float, dropout: float, key: jax.Array) -> None:
        self.weight = base.weight
        *lead, out_dim, in_dim = base.weight.shape
        out_axis, in_axis = base.weight.get_metadata()["logical_axes"]
        bound = in_dim**-0.5  # torch's kaiming_uniform(a=sqrt(5)), the usual LoRA A init
        a = jax.random.uniform(key, (*lead, rank, in_dim), F32, -bound, bound)
        self.lora_a = nnx.LoRAParam(a, logical_axes=(None, in_axis))
        self.lora_b = nnx.LoRAParam(jnp.zeros((*lead, out_dim, rank), F32), logical_axes=(out_axis, None))
        self.scale, self.dropout = alpha / rank, dropout
        self.dropout_key = (
            LoRADropoutKey(jnp.zeros((*lead, 2), jnp.uint32), logical_axes=(None,)) if dropout > 0 else None
        )
        self.deterministic = False  # static: True for evaluation (no dropout)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = linear(x, self.weight[...])
        h = x
        if self.dropout_key is not None and not self.deterministic:
            h = lora_dropout(x, self.dropout_key[...], self.dropout)
        delta = linear(linear(h, self.lora_a[...]), self.lora_b[...])
        return (y.astype(F32) + self.scale * delta.astype(F32)).astype(y.dtype)

    def merged(self) -> Linear:
        """A plain `Linear` with W + (alpha / r) B A, rounded once to the base's dtype."""
        w = self.weight[...]
        delta = jnp.einsum("...or,...ri->...oi", self.lora_b[...], self.lora_a[...], precision=jax.lax.Precision.HIGHEST)
        *_, out_dim, in_dim = w.shape
        out = nnx.eval_shape(lambda: Linear(in_dim, out_dim, dtype=w.dtype, axes=(None, None), rngs=nnx.Rngs(0)))
        out.weight = nnx.Param((w.astype(F32) + self.scale * delta).astype(w.dtype), **self.weight.get_metadata())
        return out


def module_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _parent(model: nnx.Module, path: tuple) -> nnx.Module:
    for p in path[:-1]:
        model = model[p] if isinstance(p, int) else getattr(model, p)
    return model


def add_lora(model: nnx.Module, *, rank: int, alpha: float, dropout: float, targets: tuple[str, ...], seed: int) -> list[str]:
    """Replace every targetable `Linear` whose module path matches a pattern of `targets` by a
    `LoRALinear`, and the routed experts of a matching `experts` path (e.g. pattern '*.experts') by
    `LoRARoutedExperts` (in place). Returns the adapted module paths; no match at all is an error."""
    adapted: list[str] = []
    key = jax.random.key(seed)
    for path, module in list(nnx.iter_modules(model)):
        name = module_name(path)
        if not path or not _matches(name, targets) or str(path[-1]) not in LORA_TARGETABLE:
            continue  # AttnRes queries, lm_head: read as raw weights, not called as projections
        parent = _parent(model, path)
        if isinstance(module, Linear):
            key, sub = jax.random.split(key)
            setattr(parent, path[-1], LoRALinear(module, rank=rank, alpha=alpha, dropout=dropout, key=sub))
        elif isinstance(module, (RoutedExperts, PackedRoutedExperts)):
            key, sub = jax.random.split(key)
            dtype = parent.routed_expert_down_proj.weight.dtype  # the layer's compute dtype
            setattr(parent, path[-1], LoRARoutedExperts(module, rank=rank, alpha=alpha, dropout=dropout,
                                                         dtype=dtype, key=sub))
        else:
            continue
        adapted.append(name)
    if not adapted:
        raise ValueError(f"TrainConfig.lora_targets: {targets} match no projection; LoRA can wrap "
                         f"modules named {LORA_TARGETABLE} (paths such as 'head_layers.1.self_attn.q_proj', "
                         f"'group_layers.0.block_sparse_moe.experts')")
    return adapted


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every `LoRALinear` back into a plain `Linear` and every `LoRARoutedExperts` into dense
    `RoutedExperts` (in place); returns `model`."""
    for path, module in list(nnx.iter_modules(model)):
        if isinstance(module, (LoRALinear, LoRARoutedExperts)):
            setattr(_parent(model, path), path[-1], module.merged())
    return model
