"""Pure-JAX routed experts: the oracles and the XLA production path.

The op, per token n: sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32, with
E_e(x) = w2_e @ SiTU(w1_e @ x, w3_e @ x). Expert weights keep the release layout [E, out, in].

Every implementation runs the same three steps: sort the N*k (token, expert) pairs by expert
(`sort_by_expert`), run the SiTU-GLU MLP on the rows grouped by expert (a backend's grouped MLP:
here `grouped_mlp_ragged_dot` and the all-experts oracle `grouped_mlp_dense`), and sum each token's
outputs weighted by its routing weights in fp32 (`combine_by_token`). Expert parallelism runs the
middle step on each device's local experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4 import MXFP4Experts, decode_experts
from pallas_kernels.precision import exact_if_fp32

F32 = jnp.float32
Weights = jax.Array | MXFP4Experts

# x [M, in] against w [E, out, in] with rows of x grouped by expert: contract x's dim 1 with w's dim 2.
RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
# a grouped product: (rows [M, in], weights [E, out, in], group sizes [E]) -> fp32 [M, out]
GroupedProduct = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def situ(gate: jax.Array, up: jax.Array, beta: float, linear_beta: float | None) -> jax.Array:
    """b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2) in fp32, cast back to the gate's dtype."""
    g, u = gate.astype(F32), up.astype(F32)
    capped_up = u if linear_beta is None else linear_beta * jnp.tanh(u / linear_beta)
    return (beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * capped_up).astype(gate.dtype)


def sort_by_expert(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Group the N*k (token, expert) pairs by expert: (pair order, token of each sorted pair, group sizes)."""
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    return order, order // ids.shape[1], group_sizes


def combine_by_token(outs: jax.Array, pair_weights: jax.Array, token_of: jax.Array,
                     num_tokens: int) -> jax.Array:
    """fp32 [num_tokens, out]: each sorted pair's output times its routing weight, summed per token."""
    weighted = outs.astype(F32) * pair_weights[:, None]
    return jnp.zeros((num_tokens, outs.shape[-1]), F32).at[token_of].add(weighted)


def ragged_dot(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, in] grouped by expert times w [E, out, in] -> fp32 [M, out] (`lax.ragged_dot_general`;
    rows past sum(group_sizes) come out zero)."""
    return jax.lax.ragged_dot_general(rows, w, group_sizes, RAGGED_DIMS, preferred_element_type=F32,
                                      precision=exact_if_fp32(rows.dtype))


def grouped_mlp_ragged_dot(
    rows: jax.Array, group_sizes: jax.Array, w1: Weights, w2: Weights, w3: Weights,
    *, beta: float, linear_beta: float | None, product: GroupedProduct = ragged_dot,
) -> jax.Array:
    """SiTU-GLU of rows grouped by expert -> fp32 [M, out] (the down product's accumulator; callers
    round it to rows.dtype, after any sum over devices). Gate and up are rounded to rows.dtype before
    the SiTU, its output is the down product's operand. MXFP4 weights are decoded to rows.dtype
    first. `product` replaces the grouped GEMM (the memory stand-in)."""
    dtype = rows.dtype
    w1, w2, w3 = (decode_experts(w, dtype) for w in (w1, w2, w3))
    hidden = situ(product(rows, w1, group_sizes).astype(dtype), product(rows, w3, group_sizes).astype(dtype),
                  beta, linear_beta)
    return product(hidden, w2, group_sizes)


def grouped_mlp_dense(
    rows: jax.Array, group_sizes: jax.Array, w1: Weights, w2: Weights, w3: Weights,
    *, beta: float, linear_beta: float | None,
) -> jax.Array:
    """Every expert on every row, then each row's own expert picked: the oracle of the grouped MLP
    (tiny configs only). -> [M, out] in rows.dtype; rows past sum(group_sizes) come out zero."""
    dtype = rows.dtype
    w1, w2, w3 = (decode_experts(w, dtype) for w in (w1, w2, w3))
    num_experts = w1.shape[0]
    expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right")
    outs = _all_experts(rows, w1, w2, w3, beta, linear_beta)  # [M, E, out]
    picked = jnp.take_along_axis(outs, jnp.minimum(expert, num_experts - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where((expert < num_experts)[:, None], picked, jnp.zeros_like(picked))


def _all_experts(x, w1, w2, w3, beta, linear_beta) -> jax.Array:
    """Every expert's SiTU-GLU of every row of x [N, in] -> [N, E, out] in x.dtype."""
    dtype = x.dtype
    mm = functools.partial(jnp.einsum, preferred_element_type=F32, precision=exact_if_fp32(dtype))
    gate = mm("ni,efi->nef", x, w1).astype(dtype)
    up = mm("ni,efi->nef", x, w3).astype(dtype)
    hidden = situ(gate, up, beta, linear_beta)
    return mm("nef,eof->neo", hidden, w2).astype(dtype)


def experts_all_dense(
    x: jax.Array, w1: Weights, w2: Weights, w3: Weights, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None,
) -> jax.Array:
    """Every expert on every token, then a masked weighted sum: the test oracle of the whole op (tiny
    configs only). x [N, in]; w1, w3 [E, F, in]; w2 [E, out, F]; weights [N, k] fp32; ids [N, k] ->
    [N, out] fp32."""
    w1, w2, w3 = (decode_experts(w, x.dtype) for w in (w1, w2, w3))
    outs = _all_experts(x, w1, w2, w3, beta, linear_beta)
    dense_weights = jnp.zeros(outs.shape[:2], F32).at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    return jnp.einsum("ne,neo->no", dense_weights, outs.astype(F32), precision=jax.lax.Precision.HIGHEST)


def experts_ragged_dot(
    x: jax.Array, w1: Weights, w2: Weights, w3: Weights, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None,
) -> jax.Array:
    """Dropless: sort the N*k (token, expert) pairs by expert, run grouped GEMMs with lax.ragged_dot,
    combine in fp32 -> [N, out] fp32. The reference of `routed_experts` (its "xla" implementation)."""
    order, token_of, group_sizes = sort_by_expert(ids, w1.shape[0])
    outs = grouped_mlp_ragged_dot(x[token_of], group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta)
    return combine_by_token(outs.astype(x.dtype), weights.reshape(-1)[order], token_of, ids.shape[0])
