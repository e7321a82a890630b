"""The whole routed-expert op on the "pallas_gpu" backend with chosen Triton tiles, for the kernel tests
(`routed_experts` takes the default tiles; small tiles exercise tails and padding at toy sizes)."""

from __future__ import annotations

import jax

from pallas_kernels.moe import pallas_gpu
from pallas_kernels.moe.reference import combine_by_token, sort_by_expert


def pallas_gpu_experts(x, w1, w2, w3, weights, ids, *, beta, linear_beta, gate_up_cfg=None, down_cfg=None,
                       bwd_cfg=None) -> jax.Array:
    """`routed_experts(..., implementation="pallas_gpu")` with the given Triton tiles: fp32 [N, out]."""
    order, token_of, group_sizes = sort_by_expert(ids, w1.shape[0])
    outs = pallas_gpu.grouped_mlp(x[token_of], group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta,
                                  gate_up_cfg=gate_up_cfg, down_cfg=down_cfg, bwd_cfg=bwd_cfg)
    return combine_by_token(outs.astype(x.dtype), weights.reshape(-1)[order], token_of, ids.shape[0])
