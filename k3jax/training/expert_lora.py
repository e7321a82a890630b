"""LoRA adapters on the routed experts: one rank-r adapter per expert on gate (w1), up (w3) and down (w2).

`LoRARoutedExperts` replaces a LatentMoE's `RoutedExperts` (dense) or `PackedRoutedExperts` (MXFP4) in
place. It keeps the base w1, w2, w3 (same attributes, so checkpoint names and shardings are unchanged;
frozen: no gradient is ever formed for them, and packed ones are decoded per layer for the GEMMs only,
never into a trainable copy) and adds, per weight w [E, out, in], `lora_a` [E, r, in] (uniform, bound
in^-1/2) and `lora_b` [E, out, r] (zeros, so step 0 is the base model), stacked behind the base's
leading axes like every adapter. Expert e computes

    g = W1_e x + s B1_e A1_e x,   u = W3_e x + s B3_e A3_e x,   y = W2_e h + s B2_e A2_e h,   h = SiTU(g, u)

with s = alpha / r, on the (token, expert) pairs grouped by expert exactly as the base op groups them
(`sort_by_expert`), then combined per token with the routing weights (`combine_by_token`). Each adapter
is two rank-r grouped products (`lax.ragged_dot` with the base's group sizes).

The gate and up adapters act before the SiTU, which the fused kernels of `Kernels.moe` compute inside
one kernel, so adapted experts run their base products on `lax.ragged_dot` too (the "xla"
implementation's products, with its roundings: B = 0 gives that implementation bit for bit) whatever
`Kernels.moe` names; the router, the latent projections and the shared experts are unchanged. Adapted
experts do not run expert-parallel (`LatentMoE` refuses an expert mesh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.nn.layers import F32, HIGHEST
from k3jax.nn.moe import MXFP4Weight, PackedRoutedExperts, RoutedExperts
from k3jax.training.lora_dropout import LoRADropoutKey, lora_dropout
from pallas_kernels.moe.reference import combine_by_token, ragged_dot, situ, sort_by_expert
from pallas_kernels.mxfp4 import decode_experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: all adapted


def _axes(var: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(var.get_metadata()["logical_axes"])


class LoRARoutedExperts(nnx.Module):
    def __init__(self, base: RoutedExperts | PackedRoutedExperts, *, rank: int, alpha: float, dropout: float,
                 dtype: jnp.dtype, key: jax.Array) -> None:
        """`dtype`: the layer's compute dtype, which packed experts decode to and merging writes."""
        for i, name in enumerate(EXPERT_WEIGHTS):
            w = getattr(base, name)
            setattr(self, name, w)
            *lead, num_experts, out_dim, in_dim = w.shape
            exp_axis, out_axis, in_axis = _axes(w.packed if isinstance(w, MXFP4Weight) else w)[-3:]
            bound = in_dim**-0.5  # as `LoRALinear`: torch's kaiming_uniform(a=sqrt(5)) per expert
            a = jax.random.uniform(jax.random.fold_in(key, i), (*lead, num_experts, rank, in_dim), F32, -bound, bound)
            setattr(self, f"{name}_lora_a", nnx.LoRAParam(a, logical_axes=(exp_axis, None, in_axis)))
            setattr(self, f"{name}_lora_b", nnx.LoRAParam(jnp.zeros((*lead, num_experts, out_dim, rank), F32),
                                                          logical_axes=(exp_axis, out_axis, None)))
        lead = tuple(base.w1.shape[:-3])
        self.scale, self.dropout, self.dtype = alpha / rank, dropout, jnp.dtype(dtype)
        self.dropout_key = (
            LoRADropoutKey(jnp.zeros((*lead, 2), jnp.uint32), logical_axes=(None,)) if dropout > 0 else None
        )
        self.deterministic = False  # static: True for evaluation (no dropout)

    @property
    def packed(self) -> bool:
        return isinstance(self.w1, MXFP4Weight)

    def _dropped(self, h: jax.Array, salt: int) -> jax.Array:
        """Inverted dropout of an adapter's input (identity when evaluating or without dropout)."""
        if self.dropout_key is None or self.deterministic:
            return h
        return lora_dropout(h, self.dropout_key[...], self.dropout, salt)

    def _product(self, rows: jax.Array, name: str, group_sizes: jax.Array, salt: int) -> jax.Array:
        """fp32 rows @ (W_e + s B_e A_e)^T for rows grouped by expert: the frozen base product plus the
        adapter's two rank-r grouped products."""
        w = decode_experts(getattr(self, name)[...], rows.dtype)
        a = getattr(self, f"{name}_lora_a")[...].astype(rows.dtype)
        b = getattr(self, f"{name}_lora_b")[...].astype(rows.dtype)
        low = ragged_dot(self._dropped(rows, salt), a, group_sizes).astype(rows.dtype)  # [M, r]
        return ragged_dot(rows, w, group_sizes) + self.scale * ragged_dot(low, b, group_sizes)

    def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array, *, beta: float,
                 linear_beta: float | None) -> jax.Array:
        """sum_j weights[n, j] * E'_{ids[n, j]}(x[n]) in fp32, E' the adapted expert MLP; x [N, latent],
        weights [N, k] fp32, ids [N, k] int32 -> [N, latent] fp32 (as `pallas_kernels.moe.routed_experts`)."""
        order, token_of, group_sizes = sort_by_expert(ids, self.w1.shape[0])
        rows, dtype = x[token_of], x.dtype
        gate = self._product(rows, "w1", group_sizes, 1).astype(dtype)
        up = self._product(rows, "w3", group_sizes, 3).astype(dtype)
        outs = self._product(situ(gate, up, beta, linear_beta), "w2", group_sizes, 2)
        return combine_by_token(outs.astype(dtype), weights.reshape(-1)[order], token_of, ids.shape[0])

    def merged(self) -> RoutedExperts:
        """Dense `RoutedExperts` with W + s B A per expert, rounded once to `self.dtype` (packed experts are
        decoded exactly first: the sum is not MXFP4-representable, so the result stays dense)."""
        out = nnx.eval_shape(lambda: RoutedExperts(1, 32, 1, dtype=self.dtype, rngs=nnx.Rngs(0)))
        for name in EXPERT_WEIGHTS:
            base = getattr(self, name)
            w = decode_experts(base[...], F32).astype(F32)
            delta = jnp.einsum("...eor,...eri->...eoi", getattr(self, f"{name}_lora_b")[...],
                               getattr(self, f"{name}_lora_a")[...], precision=HIGHEST)
            meta = (base.packed if isinstance(base, MXFP4Weight) else base).get_metadata()
            setattr(out, name, nnx.Param((w + self.scale * delta).astype(self.dtype), **meta))
        return out
