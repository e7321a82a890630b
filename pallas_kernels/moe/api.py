"""The routed experts' public entry points: validation, the implementation choice, sort and combine.

    out = routed_experts(x, w1, w2, w3, weights, ids, beta=b, linear_beta=lb)  # fp32 [N, out]

`implementation` names an entry of `dispatch.IMPLEMENTATIONS` ("xla", "pallas_gpu", "mosaic_tpu",
"dense", "xla_memory_standin"), or None for the policy. Weights may be `MXFP4Experts` (uint8 E2M1
codes + E8M0 scales, kept packed in HBM at 4.25 bits per weight); each implementation reads them
packed where its kernels can and decodes the rest to x's dtype right before its GEMMs. Every
implementation is exact up to the order of fp32 sums, so the packed and the decoded model agree.
The MLP on rows already grouped by expert (`grouped_mlp`) is what expert parallelism runs on each
device's local experts.
"""

from __future__ import annotations

import jax

from pallas_kernels.moe.dispatch import choose_implementation
from pallas_kernels.moe.reference import Weights, combine_by_token, sort_by_expert
from pallas_kernels.mxfp4 import MXFP4Experts


def check_weights(w1: Weights, w2: Weights, w3: Weights, d_in: int) -> None:
    """w1, w3 [E, F, in] and w2 [E, out, F] (decoded shapes), all dense or all MXFP4Experts."""
    if len({isinstance(w, MXFP4Experts) for w in (w1, w2, w3)}) != 1:
        raise ValueError("w1, w2, w3: expected all MXFP4Experts or all arrays, got "
                         + ", ".join(type(w).__name__ for w in (w1, w2, w3)))
    shapes = [tuple(w.shape) for w in (w1, w2, w3)]
    num_experts, hidden = shapes[0][0], shapes[0][1]
    if (any(len(s) != 3 for s in shapes) or shapes[2] != shapes[0] or shapes[0][2] != d_in
            or shapes[1][0] != num_experts or shapes[1][2] != hidden):
        raise ValueError(f"w1, w3 must be [E, F, {d_in}] and w2 [E, out, F] (decoded shapes); "
                         f"got w1 {shapes[0]}, w2 {shapes[1]}, w3 {shapes[2]}")


def grouped_mlp(
    rows: jax.Array, group_sizes: jax.Array, w1: Weights, w2: Weights, w3: Weights,
    *, beta: float, linear_beta: float | None, implementation: str | None = None,
) -> jax.Array:
    """SiTU-GLU of rows [M, in] grouped by expert (`group_sizes` [E] int32; rows past their sum come
    out zero) -> [M, out] in rows.dtype or fp32 (round it to rows.dtype after any sum over devices)."""
    check_weights(w1, w2, w3, rows.shape[-1])
    impl = choose_implementation(implementation, dtype=rows.dtype, packed=isinstance(w1, MXFP4Experts))
    return impl.run(rows, group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta)


def routed_experts(
    x: jax.Array, w1: Weights, w2: Weights, w3: Weights, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None, implementation: str | None = None,
) -> jax.Array:
    """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32 for SiTU-GLU experts [E, out, in].

    x [N, in]; w1, w3 [E, F, in]; w2 [E, out, F]; weights [N, k] fp32; ids [N, k] int32 -> [N, out]
    fp32. Dropless: the N*k (token, expert) pairs are sorted by expert, the experts' MLP runs on the
    grouped rows (`grouped_mlp`, the chosen implementation), and each token's outputs, rounded to x's
    dtype, are summed with its routing weights in fp32."""
    if ids.ndim != 2 or weights.shape != ids.shape or x.ndim != 2 or x.shape[0] != ids.shape[0]:
        raise ValueError(f"x [N, in], weights and ids [N, k] expected; got x {x.shape}, weights "
                         f"{weights.shape}, ids {ids.shape}")
    order, token_of, group_sizes = sort_by_expert(ids, w1.shape[0])
    outs = grouped_mlp(x[token_of], group_sizes, w1, w2, w3, beta=beta, linear_beta=linear_beta,
                       implementation=implementation)
    return combine_by_token(outs.astype(x.dtype), weights.reshape(-1)[order], token_of, ids.shape[0])
