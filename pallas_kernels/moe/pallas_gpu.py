"""Routed experts on the Pallas grouped GEMMs: sort pairs by expert, fused gate+up+SiTU, down, combine.

Same contract as `reference.experts_ragged_dot` (fp32 [N, out]); only the two grouped GEMMs differ. On a
GPU backend the kernels are compiled through Pallas-Triton, except past decode sizes the forward's gate+up
(`pallas_vjp.mosaic_gpu_gate_up_tail`), its down (`pallas_vjp.mosaic_gpu_down_tail`) and, for large groups,
the backward's products (`pallas_vjp.on_mosaic_gpu`), which are Mosaic GPU; elsewhere they run in interpret
mode (slow, for tests only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.moe.pallas_grouped_gemm import (
    TileConfig, Weight, down_config, gate_up_config,
)
from pallas_kernels.moe.pallas_vjp import expert_mlp
from pallas_kernels.moe.reference import MXFP4Experts, combine_by_token, sort_by_expert

F32 = jnp.float32


def fit_config(cfg: TileConfig, k: int, n: int, *, k_multiple: int = 16) -> TileConfig:
    """Shrink block_k / block_n (powers of two) until they divide K / N; raise if none does.

    block_n stays >= 16; block_k stays >= k_multiple (32 for MXFP4 weights: one scale byte per 32 inputs)
    and starts there if cfg's is smaller."""

    def fit(block: int, dim: int, name: str, floor: int) -> int:
        while block >= floor and dim % block:
            block //= 2
        if block < floor:
            raise ValueError(f"{name}={dim} is not a multiple of {floor}: the Pallas grouped GEMM needs that")
        return block

    block_k = fit(max(cfg.block_k, k_multiple), k, "K", k_multiple)
    return dataclasses.replace(cfg, block_k=block_k, block_n=fit(cfg.block_n, n, "N", 16))


def _pad_to(a: Weight, axis: int, multiple: int = 16) -> Weight:
    """Zero-pad one axis up to a multiple (a no-op, and no copy, for the model's real widths).

    MXFP4 weights pad their rows (zero codes decode to zero); their input width is a multiple of 32 by
    format, so padding it is always a no-op."""
    if isinstance(a, MXFP4Experts):
        if axis in (-1, a.packed.ndim - 1):
            return a
        return MXFP4Experts(_pad_to(a.packed, axis, multiple), _pad_to(a.scale, axis, multiple))
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def experts_pallas(
    x: jax.Array, w1: Weight, w2: Weight, w3: Weight, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None, interpret: bool | None = None,
    gate_up_cfg: TileConfig | None = None, down_cfg: TileConfig | None = None,
    bwd_cfg: TileConfig | None = None,
) -> jax.Array:
    """sum_j weights[n, j] * w2_e SiTU(w1_e x_n, w3_e x_n) in fp32. x [N, in]; w1, w3 [E, F, in]; w2 [E, out, F].

    Differentiable in x, w1, w2, w3 and weights: the expert MLP on the sorted rows is a `jax.custom_vjp`
    (pallas_vjp.expert_mlp: recompute gate/up, Pallas grouped GEMMs for dh and dx, and the Pallas
    row-contracting grouped GEMM `grouped_matmul_tn` for the per-expert weight gradients); gather,
    padding, routing weights and scatter-add are plain JAX. bwd_cfg: tiles of the backward's grouped GEMMs
    (None: `down_config` for bf16 weights, which merges a 32-row tail into the full tiles when experts are
    small).
    Weights may be `MXFP4Experts`: the grouped GEMMs then read the packed codes and scales and decode each
    tile in registers (mxfp4_tile.py; gate+up with large groups on the GPU: mosaic_gpu_mxfp4.py); the
    backward decodes the layer in XLA (packed weights get no gradient).
    On an H200 (2026-11-29, one ad-hoc run, before the backward's 2026-11-30 speed-ups): bf16 gradients within
    3-5e-3 of an fp32 oracle (XLA's bf16 path: the same), fwd+bwd 12.5 ms vs 1210 ms for XLA autodiff of
    experts_ragged_dot at 2048 tokens x top-8, 28 experts, 3584 -> 3072. The expert MLP alone now runs
    1.38x torch's grouped GEMMs with autograd (benchmarks/RESULTS.md).
    """
    num_tokens = ids.shape[0]
    order, token_of, group_sizes = sort_by_expert(ids, w1.shape[0])
    outs = grouped_expert_mlp(x[token_of], group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta,
                              interpret=interpret, gate_up_cfg=gate_up_cfg, down_cfg=down_cfg, bwd_cfg=bwd_cfg)
    return combine_by_token(outs, weights.reshape(-1)[order], token_of, num_tokens)


def grouped_expert_mlp(
    rows: jax.Array, group_sizes: jax.Array, w1: Weight, w2: Weight, w3: Weight,
    *, beta: float, linear_beta: float | None, interpret: bool | None = None,
    gate_up_cfg: TileConfig | None = None, down_cfg: TileConfig | None = None,
    bwd_cfg: TileConfig | None = None,
) -> jax.Array:
    """SiTU-GLU of rows already grouped by expert -> [M, out] in rows.dtype; rows past sum(group_sizes)
    come out zero. The unit that expert parallelism runs on each device's local experts.

    rows [M, in]; group_sizes [E] int32; weights as `experts_pallas`. Differentiable (pallas_vjp.expert_mlp).
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    num_experts, d_out = w1.shape[0], w2.shape[1]
    # Widths that are not multiples of 16 (toy configs only) are zero-padded: zero K columns add nothing,
    # zero gate/up rows give SiTU(0, 0) = 0 hidden units, and padded output columns are sliced off.
    rows = _pad_to(rows, 1)
    w1, w3 = (_pad_to(_pad_to(w, 2), 1) for w in (w1, w3))
    w2 = _pad_to(_pad_to(w2, 2), 1)
    gate_up_cfg = gate_up_cfg or gate_up_config(rows.shape[0], num_experts, isinstance(w1, MXFP4Experts))
    down_cfg = down_cfg or down_config(rows.shape[0], num_experts, isinstance(w2, MXFP4Experts))
    bwd_cfg = bwd_cfg or down_config(rows.shape[0], num_experts, backward=True)
    outs = expert_mlp(rows, w1, w2, w3, group_sizes, float(beta),
                      None if linear_beta is None else float(linear_beta), bool(interpret), gate_up_cfg,
                      down_cfg, bwd_cfg)
    return outs[:, :d_out]
