"""Single-instruction fp32 math for the GPU kernels' bf16 paths (PTX through Triton inline asm).

libdevice's ``expf`` takes about eight instructions and an IEEE division about ten; the PTX
``ex2.approx.ftz.f32`` and ``rcp.approx.ftz.f32`` are one each on the special-function unit.
Their relative errors (2 ulp for ``ex2`` plus the rounding of its argument, 1 ulp for ``rcp``;
results below 2^-126 flush to zero) sit far below the bf16 rounding (2^-9) of everything the
kernels that use them produce. GPU only: Triton lowers them, interpret mode cannot, so callers
take them only off interpret mode and keep the exact ops for fp32 and for tests on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

LOG2E = 1.4426950408889634


def _unary(instruction: str, x: jax.Array) -> jax.Array:
    [y] = pl_triton.elementwise_inline_asm(
        f"{instruction} $0, $1;", args=[x.astype(jnp.float32)], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y


def exp2(x: jax.Array) -> jax.Array:
    """``2**x`` by ``ex2.approx.ftz.f32``."""
    return _unary("ex2.approx.ftz.f32", x)


def reciprocal(x: jax.Array) -> jax.Array:
    """``1 / x`` by ``rcp.approx.ftz.f32`` (``1 / inf = 0``)."""
    return _unary("rcp.approx.ftz.f32", x)


def sigmoid(x: jax.Array) -> jax.Array:
    """``1 / (1 + e^-x)`` as ``rcp(1 + ex2(-x log2 e))``: four instructions, and the right
    limits for large ``|x|`` (``e^-x`` overflowing to inf gives 0, underflowing gives 1)."""
    return reciprocal(1.0 + exp2(x * -LOG2E))
