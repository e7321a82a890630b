"""One entry point for the routed experts; picks an implementation per platform."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import experts_all_dense, experts_ragged_dot

Implementation = Literal["auto", "xla", "dense", "pallas"]


def routed_experts(
    x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None, implementation: Implementation = "auto",
) -> jax.Array:
    """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32 for SiTU-GLU experts [E, out, in].

    "auto" picks "pallas" for bf16 on GPU (where the kernel is compiled and verified, see
    benchmarks/RESULTS.md) and "xla" elsewhere (CPU; TPU until the Mosaic-TPU kernel exists; fp32, which
    must stay exact). "xla" runs the dropless sorted `lax.ragged_dot` path; "dense" runs every expert on every
    token (the oracle); "pallas" runs the Pallas grouped GEMMs (gate+up+SiTU fused, then down; see
    pallas_grouped_gemm.py): compiled through Pallas-Triton on GPU, interpret mode elsewhere (tests only).
    """
    if implementation == "auto":
        implementation = "pallas" if jax.default_backend() == "gpu" and x.dtype == jnp.bfloat16 else "xla"
    if implementation == "xla":
        return experts_ragged_dot(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    if implementation == "dense":
        return experts_all_dense(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    if implementation == "pallas":
        # imported here so that the default paths never import Pallas
        from pallas_kernels.moe.pallas_experts import experts_pallas  # noqa: PLC0415

        return experts_pallas(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    raise ValueError(f"implementation={implementation!r}: expected 'auto', 'xla', 'dense' or 'pallas'")
