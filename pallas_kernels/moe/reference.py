"""Pure-JAX routed-expert computation: the oracle and the XLA production path.

Both compute, per token n, sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32, with
E_e(x) = w2_e @ SiTU(w1_e @ x, w3_e @ x). Expert weights keep the release layout [E, out, in].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.precision import exact_if_fp32

F32 = jnp.float32


class MXFP4Experts(NamedTuple):
    """Routed-expert weights kept MXFP4-packed, as the release stores them (4.25 bits per weight).

    packed: uint8 [..., E, out, in/2], two E2M1 codes per byte (even input column in the low nibble);
    scale: uint8 [..., E, out, in/32], raw E8M0 bytes (2^(byte - 127)) per block of 32 inputs.
    """

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded shape [..., E, out, in]."""
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def decode(self, dtype) -> jax.Array:
        """E2M1(code) * 2^(scale - 127) in float32, cast to `dtype` (exact for bf16 and fp32: E2M1 has one
        mantissa bit). Under jit this is an elementwise op XLA fuses into the producer of the GEMM operand."""
        # here, not at the top: pallas_kernels must not import k3jax at import time (k3jax imports it)
        from k3jax.checkpoint.mxfp4 import decode_mxfp4_jax  # noqa: PLC0415

        return decode_mxfp4_jax(self.packed, self.scale, dtype)


def decode_experts(w: "jax.Array | MXFP4Experts", dtype) -> jax.Array:
    """Expert weights as a dense [E, out, in] array of `dtype`; dense arrays pass through unchanged."""
    return w.decode(dtype) if isinstance(w, MXFP4Experts) else w

# x [M, in] against w [E, out, in] with rows of x grouped by expert: contract x's dim 1 with w's dim 2.
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


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


def experts_all_dense(
    x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None,
) -> jax.Array:
    """Every expert on every token, then a masked weighted sum: the test oracle (tiny configs only).

    x [N, in]; w1, w3 [E, F, in]; w2 [E, in_out, F]; weights [N, k] fp32; ids [N, k] -> [N, out] fp32.
    """
    dtype = x.dtype
    mm = functools.partial(jnp.einsum, preferred_element_type=F32, precision=exact_if_fp32(dtype))
    gate = mm("ni,efi->nef", x, w1).astype(dtype)
    up = mm("ni,efi->nef", x, w3).astype(dtype)
    hidden = situ(gate, up, beta, linear_beta)
    outs = mm("nef,eof->neo", hidden, w2).astype(dtype)  # [N, E, out]
    dense_weights = jnp.zeros(outs.shape[:2], F32).at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    return jnp.einsum("ne,neo->no", dense_weights, outs.astype(F32), precision=jax.lax.Precision.HIGHEST)


def experts_ragged_dot(
    x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None, gate_up: Callable[..., jax.Array] | None = None,
    down: Callable[..., jax.Array] | None = None,
) -> jax.Array:
    """Dropless: sort the N*k (token, expert) pairs by expert and run grouped GEMMs with lax.ragged_dot.

    `gate_up(rows, w1, w3, group_sizes)` may replace the gate/up GEMMs + SiTU with a fused kernel and
    `down(hidden, w2, group_sizes)` the down GEMM (the Mosaic-TPU kernels); sorting and the combine stay
    as here."""
    order, token_of, group_sizes = sort_by_expert(ids, w1.shape[0])
    rows = x[token_of]  # [N*k, in], grouped by expert

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DIMS, preferred_element_type=F32,
                                         precision=exact_if_fp32(x.dtype))
        return out.astype(x.dtype)

    if gate_up is None:
        hidden = situ(grouped(rows, w1), grouped(rows, w3), beta, linear_beta)
    else:
        hidden = gate_up(rows, w1, w3, group_sizes).astype(x.dtype)
    outs = grouped(hidden, w2) if down is None else down(hidden, w2, group_sizes)
    return combine_by_token(outs, weights.reshape(-1)[order], token_of, ids.shape[0])
