"""Stable LatentMoE: sigmoid-routed experts that run in a latent space, plus full-width shared experts.

Router (fp32, on the full-width input): scores = sigmoid(x W_g^T); experts chosen by top-k of
scores + e_score_correction_bias (the Quantile-Balancing bias, selection only); weights are the
unbiased scores of the chosen experts, renormalised and scaled. Routed path: down-project to the
latent width, run the chosen SiTU-GLU experts, weighted sum in fp32, RMSNorm, up-project. Shared
experts see the full-width input (k3-architecture.md §4).

Routed experts are either dense (`RoutedExperts`) or kept MXFP4-packed as the release stores them
(`PackedRoutedExperts`, 4.25 bits per weight in HBM; each implementation of the routed experts reads them
packed where its kernels can and decodes the rest one layer at a time right before its GEMMs, see
pallas_kernels/moe/api.py); `pack_routed_experts` turns a model's experts into the packed form (used on
abstract models by the loaders, which then fill in the release's codes and scales).

Which implementation runs the routed experts is the model's `Kernels.moe` (k3jax/kernels.py), honoured
on one device and, when `sharding` gives the layer an expert mesh, expert-parallel.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.nn.layers import F32, HIGHEST, Linear, RMSNorm, declare, normal_init
from k3jax.nn.situ import SiTUMLP
from pallas_kernels.moe import MXFP4Experts, routed_experts
from pallas_kernels.mxfp4 import BLOCK, check_mxfp4
from sharding.expert_parallel import ep_routed_experts


def route_topk(
    x: jax.Array, gate_weight: jax.Array, bias: jax.Array, top_k: int, renormalize: bool, scaling: float
) -> tuple[jax.Array, jax.Array]:
    """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
    logits = jnp.einsum("nd,ed->ne", x.astype(F32), gate_weight.astype(F32), precision=HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(scores + bias.astype(F32), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, ids.astype(jnp.int32)


BALANCE_BINS = 1000  # Quantile Balancing histogram bins per expert (k3-architecture.md §5.3)


class RouterBias(nnx.Variable):
    """The routing bias `e_score_correction_bias`: state, not a parameter. It changes which experts are
    chosen, never the mixing weights, so it has no useful gradient; training updates it outside the
    gradient (Quantile Balancing) and no optimizer over `nnx.Param` ever sees it."""


class RouterStats(NamedTuple):
    """One MoE layer's routing statistics over the valid tokens of a batch (training, no gradient).

    histogram int32 [E, BALANCE_BINS]: counts of r_ij = alpha_i - s_ij (alpha_i the (k+1)-th largest
    biased score of token i) in uniform bins over [min(bias) - 1, max(bias) + 1]; load int32 [E]:
    tokens routed to each expert."""

    histogram: jax.Array
    load: jax.Array


def router_stats(
    x: jax.Array, gate_weight: jax.Array, bias: jax.Array, top_k: int, valid: jax.Array | None
) -> RouterStats:
    """Quantile-Balancing histogram and expert loads of x [N, D] under the current `bias` (fp32);
    `valid` bool [N] excludes padding tokens."""
    x, gate_weight, bias = (jax.lax.stop_gradient(a) for a in (x, gate_weight, bias))
    num_experts = gate_weight.shape[0]
    scores = jax.nn.sigmoid(jnp.einsum("nd,ed->ne", x.astype(F32), gate_weight.astype(F32), precision=HIGHEST))
    biased = scores + bias.astype(F32)
    top, ids = jax.lax.top_k(biased, top_k + 1)
    alpha = top[:, top_k]  # the token's cutoff: an expert must beat it to be chosen
    low = jnp.min(bias) - 1.0
    width = (jnp.max(bias) - jnp.min(bias) + 2.0) / BALANCE_BINS
    bins = jnp.clip(jnp.floor((alpha[:, None] - scores - low) / width), 0, BALANCE_BINS - 1).astype(jnp.int32)
    weight = jnp.ones(x.shape[0], jnp.int32) if valid is None else valid.astype(jnp.int32)
    flat = (jnp.arange(num_experts, dtype=jnp.int32) * BALANCE_BINS + bins).reshape(-1)
    histogram = jnp.zeros(num_experts * BALANCE_BINS, jnp.int32).at[flat].add(jnp.repeat(weight, num_experts))
    load = jnp.zeros(num_experts, jnp.int32).at[ids[:, :top_k].reshape(-1)].add(jnp.repeat(weight, top_k))
    return RouterStats(histogram.reshape(num_experts, BALANCE_BINS), load)


class RouterGate(nnx.Module):
    def __init__(self, hidden: int, num_experts: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.weight = declare(rngs, (num_experts, hidden), dtype, ("exp", "embed"), normal_init(hidden**-0.5))
        self.e_score_correction_bias = RouterBias(
            normal_init(0.1)(rngs.params(), (num_experts,), F32), logical_axes=("exp",)
        )


class RoutedExperts(nnx.Module):
    """All routed experts stacked: w1 (gate), w3 (up) [E, F, latent]; w2 (down) [E, latent, F]."""

    def __init__(self, num_experts: int, latent: int, inter: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        up_axes = ("exp", "mlp_moe", "embed_moe")
        self.w1 = declare(rngs, (num_experts, inter, latent), dtype, up_axes, normal_init(1.5 / latent**0.5))
        self.w3 = declare(rngs, (num_experts, inter, latent), dtype, up_axes, normal_init(1 / latent**0.5))
        self.w2 = declare(
            rngs, (num_experts, latent, inter), dtype, ("exp", "embed_moe", "mlp_moe"), normal_init(1 / inter**0.5)
        )


class MXFP4Weight(nnx.Module):
    """One stacked expert weight [..., E, out, in] kept packed: `packed` uint8 [..., E, out, in/2] (two E2M1
    codes per byte) and `scale` uint8 [..., E, out, in/32] (E8M0). Both carry the dense weight's logical
    axes, so expert / tensor sharding splits them like the dense weight. `w[...]` gives the
    `MXFP4Experts` pair that `routed_experts` decodes."""

    def __init__(self, packed: jax.Array, scale: jax.Array, axes: tuple[str | None, ...]) -> None:
        check_mxfp4(packed, scale)
        self.packed = nnx.Param(packed, logical_axes=axes)
        self.scale = nnx.Param(scale, logical_axes=axes)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> "MXFP4Weight":
        """Placeholder codes/scales for a dense weight of `shape` [..., in] (in a multiple of 32)."""
        *rows, cols = shape
        if cols % BLOCK:
            raise ValueError(f"MXFP4 needs the input width to be a multiple of {BLOCK}, got shape {shape}")
        return cls(jnp.zeros((*rows, cols // 2), jnp.uint8), jnp.zeros((*rows, cols // BLOCK), jnp.uint8), axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def __getitem__(self, index) -> MXFP4Experts:
        if index is not Ellipsis:
            raise IndexError("an MXFP4Weight is only read whole: w[...]")
        return MXFP4Experts(self.packed[...], self.scale[...])


class PackedRoutedExperts(nnx.Module):
    """`RoutedExperts` with w1, w2, w3 as `MXFP4Weight`s (same shapes once decoded, same logical axes)."""

    def __init__(self, dense: RoutedExperts) -> None:
        for name in ("w1", "w2", "w3"):
            var = getattr(dense, name)
            setattr(self, name, MXFP4Weight.zeros(tuple(var.shape), var.get_metadata()["logical_axes"]))


def pack_routed_experts(model: nnx.Module) -> nnx.Module:
    """Give every LatentMoE in `model` packed routed experts (zero codes and scales, to be filled by a loader).

    Meant for `nnx.eval_shape(lambda: pack_routed_experts(K3Model.init(cfg)))`; stacked scan groups keep
    their leading layer axis. Returns `model`, modified in place."""
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, LatentMoE) and isinstance(module.experts, RoutedExperts):
            module.experts = PackedRoutedExperts(module.experts)
    return model


class LatentMoE(nnx.Module):
    """Router, latent routed experts and shared experts. `kernels.moe` picks the routed experts'
    implementation (an entry of `pallas_kernels.moe.IMPLEMENTATIONS`, or None for its policy)."""

    def __init__(self, cfg: K3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs, kernels: Kernels = Kernels()) -> None:
        d, latent = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = RouterGate(d, cfg.num_experts, dtype=dtype, rngs=rngs)
        self.routed_expert_down_proj = Linear(d, latent, dtype=dtype, axes=("embed_moe", "embed"), rngs=rngs)
        self.experts = RoutedExperts(cfg.num_experts, latent, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.routed_expert_norm = (
            RMSNorm(latent, cfg.rms_norm_eps, dtype=dtype, axis="embed_moe", rngs=rngs) if cfg.latent_moe_use_norm else None
        )
        self.routed_expert_up_proj = Linear(latent, d, dtype=dtype, axes=("embed", "embed_moe"), rngs=rngs, gain=0.2)
        self.shared_experts = (
            SiTUMLP(d, cfg.shared_intermediate_size, cfg.situ_beta, cfg.situ_linear_beta, dtype=dtype,
                    mlp_axis="mlp", rngs=rngs)
            if cfg.num_shared_experts else None
        )
        self.top_k, self.renormalize, self.scaling = cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta
        self.kernels = kernels  # static: part of the model's structure
        # Set by `sharding.shard_model` when the mesh splits experts: routed experts then run
        # expert-parallel under shard_map (sharding/expert_parallel.py) instead of through GSPMD.
        self.expert_mesh: Mesh | None = None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] (post-attention-normalised) -> (output [B, T, D], chosen expert ids [B, T, k])."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = route_topk(
            flat, self.gate.weight[...], self.gate.e_score_correction_bias[...], self.top_k, self.renormalize, self.scaling
        )
        latent_in = self.routed_expert_down_proj(flat)
        if not isinstance(self.experts, (RoutedExperts, PackedRoutedExperts)):
            mixed = self._adapted_experts(latent_in, weights, ids)
        elif self.expert_mesh is None:
            w1, w2, w3 = self.experts.w1[...], self.experts.w2[...], self.experts.w3[...]
            mixed = routed_experts(latent_in, w1, w2, w3, weights, ids, beta=self.beta, linear_beta=self.linear_beta,
                                   implementation=self.kernels.moe)
        else:
            w1, w2, w3 = self.experts.w1[...], self.experts.w2[...], self.experts.w3[...]
            mixed = ep_routed_experts(latent_in, w1, w2, w3, weights, ids, mesh=self.expert_mesh, beta=self.beta,
                                      linear_beta=self.linear_beta, implementation=self.kernels.moe)
        mixed = mixed.astype(x.dtype)
        if self.routed_expert_norm is not None:
            mixed = self.routed_expert_norm(mixed)
        out = self.routed_expert_up_proj(mixed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(x.shape), ids.reshape(*x.shape[:-1], -1)

    def _adapted_experts(self, latent_in: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        """Routed experts that run themselves (fine-tuning's per-expert LoRA adapters,
        k3jax/training/expert_lora.py): same routing, same [N, latent] fp32 mix; no expert parallelism."""
        if self.expert_mesh is not None:
            raise ValueError("LoRA on the routed experts (lora target '*.experts', --lora-experts) does not run "
                             "expert-parallel; use a mesh without an 'expert' axis (e.g. --mesh data=N)")
        return self.experts(latent_in, weights, ids, beta=self.beta, linear_beta=self.linear_beta)

    def router_stats(self, x: jax.Array, valid: jax.Array | None = None) -> RouterStats:
        """`router_stats` of x [B, T, D] (the layer's input) under this layer's bias; `valid` bool [B, T]."""
        flat = x.reshape(-1, x.shape[-1])
        return router_stats(flat, self.gate.weight[...], self.gate.e_score_correction_bias[...], self.top_k,
                            None if valid is None else valid.reshape(-1))
