"""A stand-in of the routed experts for memory planning on CPU: right shapes and dtypes, the device
kernels' memory footprint, meaningless values.

Why: on CPU, JAX lowers `lax.ragged_dot` by expanding the rows to a dense [groups, rows, K] operand
(tens of GB for one K3 prefill chunk at hundreds of local experts), which no GPU or TPU run has: the
Pallas grouped GEMMs and XLA's native ragged dot read rows in place. The stand-in contracts the rows
with the experts' sum over the group axis instead: same output shape and dtype, the same decoded
expert weights live, the group axis reduced locally where it is sharded (as expert-parallel dispatch
keeps each device on its own experts), and no [groups, rows, K] buffer. Only memory may be read from
a program built with it (`Kernels(moe="xla_memory_standin")`); its FLOPs and numbers are not the
model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.reference import RAGGED_DIMS, Weights, grouped_mlp_ragged_dot
from pallas_kernels.precision import exact_if_fp32

F32 = jnp.float32


def summed_experts_product(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, in] times the sum of w [E, out, in] over experts -> fp32 [M, out]: the shape and dtype
    of the grouped product, without its values."""
    del group_sizes
    (lhs_contract, rhs_contract), batch = RAGGED_DIMS.dot_dimension_numbers
    (group,) = RAGGED_DIMS.rhs_group_dimensions
    summed = w.sum(axis=group, dtype=w.dtype)
    rhs_contract = [d - (d > group) for d in rhs_contract]
    return jax.lax.dot_general(rows, summed, ((lhs_contract, rhs_contract), batch),
                               precision=exact_if_fp32(rows.dtype), preferred_element_type=F32)


def grouped_mlp_memory_standin(
    rows: jax.Array, group_sizes: jax.Array, w1: Weights, w2: Weights, w3: Weights,
    *, beta: float, linear_beta: float | None,
) -> jax.Array:
    """`reference.grouped_mlp_ragged_dot` with every grouped GEMM replaced by `summed_experts_product`."""
    return grouped_mlp_ragged_dot(rows, group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta,
                                  product=summed_experts_product)
