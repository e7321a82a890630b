"""One entry point for the routed experts; picks an implementation per platform."""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.moe.batch_size import is_decode_sized
from pallas_kernels.moe.reference import MXFP4Experts, decode_experts, experts_all_dense, experts_ragged_dot
from pallas_kernels.precision import exact_if_fp32

Implementation = Literal["auto", "xla", "dense", "pallas"]


Weights = jax.Array | MXFP4Experts


def auto_implementation(dtype: jnp.dtype) -> str:
    """What "auto" runs: the Pallas kernels for bf16 on GPU, the XLA path elsewhere (see
    `routed_experts`)."""
    return "pallas" if jax.default_backend() == "gpu" and dtype == jnp.bfloat16 else "xla"


def mxfp4_in_kernels(implementation: str, pairs: int, num_experts: int) -> bool:
    """Whether MXFP4 experts go packed into the kernels instead of being decoded first: the Pallas
    grouped GEMMs (not on TPU) on a decode-sized batch of `pairs` routed rows (see `routed_experts`)."""
    return implementation == "pallas" and jax.default_backend() != "tpu" and is_decode_sized(pairs, num_experts)


def mxfp4_gate_up_in_mosaic_gpu(implementation: str, x: jax.Array, w1: Weights, w3: Weights,
                                pairs: int) -> bool:
    """Whether a large batch keeps packed gate/up weights for the Mosaic GPU kernel that decodes them
    in registers (``mosaic_gpu_mxfp4``): the Pallas kernels on a GPU, where the Triton kernels would
    take their large-group tiles (the bf16 kernels' Mosaic GPU territory). On an H100 it ran at
    0.90x the bf16 kernel on bf16 weights (median of eleven), against 0.59x for decoding the layer
    first (the whole routed layer at 2048 tokens x top-8: 1.24x faster)."""
    if implementation != "pallas" or jax.default_backend() != "gpu":
        return False
    if not (isinstance(w1, MXFP4Experts) and isinstance(w3, MXFP4Experts)):
        return False
    from pallas_kernels.moe import mosaic_gpu_mxfp4  # noqa: PLC0415 (Pallas only on this path)
    from pallas_kernels.moe.pallas_grouped_gemm import GATE_UP_MXFP4, gate_up_config  # noqa: PLC0415

    rows = jax.ShapeDtypeStruct((pairs, x.shape[-1]), x.dtype)
    return (gate_up_config(pairs, w1.shape[0], mxfp4=True) == GATE_UP_MXFP4
            and mosaic_gpu_mxfp4.takes(rows, w1, w3))


def routed_experts(
    x: jax.Array, w1: Weights, w2: Weights, w3: Weights, weights: jax.Array, ids: jax.Array,
    *, beta: float, linear_beta: float | None, implementation: Implementation = "auto",
) -> jax.Array:
    """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) in fp32 for SiTU-GLU experts [E, out, in].

    "auto" picks "pallas" for bf16 on GPU (where the kernel is compiled and verified, see
    benchmarks/RESULTS.md) and "xla" elsewhere (CPU; TPU until the Mosaic-TPU kernel exists; fp32, which
    must stay exact). "xla" runs the dropless sorted `lax.ragged_dot` path; "dense" runs every expert on every
    token (the oracle); "pallas" runs the Pallas grouped GEMMs (gate+up+SiTU fused, then down; see
    pallas_grouped_gemm.py): compiled through Pallas-Triton on GPU (the forward's gate+up and down through
    Mosaic GPU for large groups, mosaic_gpu_grouped_gemm.py), interpret mode elsewhere (tests only).

    Weights may be `MXFP4Experts` (uint8 E2M1 codes + E8M0 scales, kept packed in HBM at 4.25 bits per
    weight). The Pallas kernels on a GPU read them packed and decode each tile in registers when the batch
    is decode-sized (at most 32 routed rows per expert on average, `is_decode_sized`): there the weight
    bytes set the time, and on the H200 (256 rows, 28 experts, 2026-11-30) the packed gate+up / down took
    0.39-0.40 / 0.22-0.23 ms, about as fast as the bf16 kernels on bf16 weights (0.36-0.39 / 0.20-0.23),
    where decoding the layer in XLA alone takes about 0.78 / 0.41 ms. Otherwise every implementation
    decodes the whole layer's experts to x's dtype right before its GEMMs (`decode_experts`; a transient
    copy of one layer's experts): at 16384 rows the tile decode ran 224 / 238 TFLOP/s (gate+up 269 with
    later tiles) against 342 / 339 for decoding first (benchmarks/moe_mxfp4_h200.py). Large batches whose
    gate+up the Mosaic GPU kernels run keep gate and up packed for ``mosaic_gpu_mxfp4``, which decodes
    them in registers (`mxfp4_gate_up_in_mosaic_gpu`). All are exact up to the order of fp32 sums, so
    the packed and the decoded model agree.
    """
    if implementation == "auto":
        implementation = auto_implementation(x.dtype)
    if mxfp4_gate_up_in_mosaic_gpu(implementation, x, w1, w3, ids.size):
        w2 = decode_experts(w2, x.dtype)  # gate and up stay packed; the down projection decodes first
    elif not mxfp4_in_kernels(implementation, ids.size, w1.shape[0]):
        w1, w2, w3 = (decode_experts(w, x.dtype) for w in (w1, w2, w3))
    if implementation == "xla":
        return experts_ragged_dot(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    if implementation == "dense":
        return experts_all_dense(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    if implementation == "pallas" and jax.default_backend() == "tpu":
        # Mosaic-TPU fused gate+up+SiTU and grouped down GEMM (tested in TPU interpret mode, not yet on
        # hardware, so "auto" does not pick them)
        return _tpu_experts(x, w1, w2, w3, weights, ids, float(beta),
                            None if linear_beta is None else float(linear_beta))
    if implementation == "pallas":
        # imported here so that the default paths never import Pallas
        from pallas_kernels.moe.pallas_experts import experts_pallas  # noqa: PLC0415

        return experts_pallas(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    raise ValueError(f"implementation={implementation!r}: expected 'auto', 'xla', 'dense' or 'pallas'")


def _tpu_forward(x, w1, w2, w3, weights, ids, beta, linear_beta):
    from pallas_kernels.moe.pallas_mosaic_tpu import (  # noqa: PLC0415 (TPU path only)
        tpu_grouped_gate_up_situ, tpu_grouped_matmul,
    )

    precision = exact_if_fp32(x.dtype)
    gate_up = functools.partial(tpu_grouped_gate_up_situ, beta=beta, linear_beta=linear_beta,
                                precision=precision)
    down = functools.partial(tpu_grouped_matmul, precision=precision)
    return experts_ragged_dot(x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta,
                              gate_up=gate_up, down=down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _tpu_experts(x, w1, w2, w3, weights, ids, beta, linear_beta):
    """The Mosaic-TPU forward, differentiable through the VJP of the ragged_dot reference (recomputed
    from the inputs): there is no TPU backward kernel yet."""
    return _tpu_forward(x, w1, w2, w3, weights, ids, beta, linear_beta)


def _tpu_experts_fwd(x, w1, w2, w3, weights, ids, beta, linear_beta):
    return _tpu_forward(x, w1, w2, w3, weights, ids, beta, linear_beta), (x, w1, w2, w3, weights, ids)


def _tpu_experts_bwd(beta, linear_beta, inputs, cotangent):
    *floats, ids = inputs
    reference = lambda x, w1, w2, w3, weights: experts_ragged_dot(  # noqa: E731
        x, w1, w2, w3, weights, ids, beta=beta, linear_beta=linear_beta)
    _, vjp = jax.vjp(reference, *floats)
    return (*vjp(cotangent), None)


_tpu_experts.defvjp(_tpu_experts_fwd, _tpu_experts_bwd)
