"""The "mosaic_tpu" implementation of the routed experts: the Mosaic TPU grouped GEMMs forward
(gate+up+SiTU fused, then down), gradients from the XLA reference (there is no TPU backward kernel).

It has not run on TPU hardware yet, so the policy never picks it; asked for by name on a CPU it runs
in the TPU interpreter (tests). MXFP4 weights are decoded to the rows' dtype first.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moe.mosaic_tpu.grouped_gemm import tpu_grouped_gate_up_situ, tpu_grouped_matmul
from pallas_kernels.moe.reference import Weights
from pallas_kernels.moe.vjp import GroupedProducts, expert_mlp
from pallas_kernels.mxfp4 import decode_experts
from pallas_kernels.platform import current_platform
from pallas_kernels.precision import exact_if_fp32


def _interpret() -> pltpu.InterpretParams | bool:
    """The TPU interpreter off a TPU (tests on CPU), the compiled kernels on one."""
    return False if current_platform() == "tpu" else pltpu.InterpretParams()


def grouped_mlp(rows: jax.Array, group_sizes: jax.Array, w1: Weights, w2: Weights, w3: Weights,
                *, beta: float, linear_beta: float | None) -> jax.Array:
    """SiTU-GLU of rows grouped by expert on the Mosaic TPU kernels -> [M, out] in rows.dtype."""
    dtype = rows.dtype
    w1, w2, w3 = (decode_experts(w, dtype) for w in (w1, w2, w3))
    precision, interpret = exact_if_fp32(dtype), _interpret()

    def gate_up(x, a, b, sizes, beta, linear_beta):
        return tpu_grouped_gate_up_situ(x, a, b, sizes, beta=beta, linear_beta=linear_beta,
                                        precision=precision, interpret=interpret)

    down = functools.partial(tpu_grouped_matmul, precision=precision, interpret=interpret)
    products = GroupedProducts(gate_up_situ=gate_up, down=down)  # no backward kernels: the reference's VJP
    return expert_mlp(rows, w1, w2, w3, group_sizes, products, float(beta),
                      None if linear_beta is None else float(linear_beta))
