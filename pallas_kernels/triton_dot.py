"""``acc + a @ b`` as one Triton dot, for the Pallas-Triton kernels' accumulating loops.

Pallas-Triton lowers every ``lax.dot_general`` to ``tt.dot(a, b, zeros)`` with the zeros a
``tt.splat`` of a scalar constant, so ``acc + dot(a, b)`` is a dot plus a separate ``arith.addf``.
Triton's combine pass folds such an add into the dot only when the zeros are a dense constant,
which the splat is not, so the two stay apart. On sm_90 each k step of a GEMM loop then waits for
its wgmma to finish (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) and adds the result into a second copy of
the accumulator: in the grouped gate+up GEMM, 128 FADDs per thread and k step, 233 SASS
instructions per step instead of 104 and 255 registers instead of 176 (Triton 3.6, sm_90,
compiled offline). ``dot_accumulate`` lowers straight to ``tt.dot(a, b, acc)``, so the accumulator
stays in the MMA and consecutive k steps' wgmmas overlap.

Why a private hook: Pallas-Triton has no public way to add a Triton op, so the lowering rule goes
into its rule table (``jax._src``; jax is pinned to 0.11.2, and jax 0.12 drops Pallas-Triton).
Everywhere else (interpret mode on CPU, plain jit) the primitive is ``acc + lax.dot_general``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax.extend.core import Primitive
from jax.interpreters import mlir

# operand precision: "low" (bf16/fp16 operands as given), "tf32" (fp32 operands rounded to TF32),
# "ieee" (fp32 operands, exact fp32 products)
PRECISIONS = ("low", "tf32", "ieee")
_LAX_PRECISION = {"low": lax.Precision.DEFAULT, "tf32": lax.Precision.HIGH, "ieee": lax.Precision.HIGHEST}

dot_accumulate_p = Primitive("k3_dot_accumulate")


def dot_accumulate(acc: jax.Array, a: jax.Array, b: jax.Array, *, trans_a: bool = False,
                   trans_b: bool = False, precision: str = "low") -> jax.Array:
    """``acc + op(a) @ op(b)`` with ``op`` an optional transpose; acc fp32 [M, N], a and b of one
    dtype. ``precision`` as in PRECISIONS ("low" for bf16/fp16 operands)."""
    if precision not in PRECISIONS:
        raise ValueError(f"dot_accumulate: precision must be one of {PRECISIONS}, got {precision!r}")
    if a.dtype != b.dtype:
        raise ValueError(f"dot_accumulate: a and b need one dtype, got {a.dtype} and {b.dtype}")
    if precision != "low" and a.dtype != jnp.float32:
        raise ValueError(f"dot_accumulate: precision={precision!r} is for fp32 operands, got {a.dtype}")
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    ka, kb = (a.shape[0] if trans_a else a.shape[1]), (b.shape[1] if trans_b else b.shape[0])
    if acc.dtype != jnp.float32 or acc.shape != (m, n) or ka != kb:
        raise ValueError(f"dot_accumulate: acc {acc.dtype}{list(acc.shape)} does not fit a{list(a.shape)}"
                         f" (trans_a={trans_a}) @ b{list(b.shape)} (trans_b={trans_b}); want fp32 [{m}, {n}]")
    return dot_accumulate_p.bind(acc, a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _reference(acc, a, b, *, trans_a, trans_b, precision):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    p = _LAX_PRECISION[precision]
    return acc + lax.dot_general(a, b, (dims, ((), ())), precision=(p, p), preferred_element_type=jnp.float32)


def _abstract(acc, a, b, **_):
    return jax.core.ShapedArray(acc.shape, acc.dtype)


def _triton(ctx, acc, a, b, *, trans_a, trans_b, precision):
    del ctx
    if trans_a:
        a = tt_dialect.trans(a, (1, 0))
    if trans_b:
        b = tt_dialect.trans(b, (1, 0))
    input_precision = {"low": None, "tf32": tt_dialect.InputPrecision.TF32,
                       "ieee": tt_dialect.InputPrecision.IEEE}[precision]
    return tt_dialect.dot(a, b, acc, input_precision=input_precision)


dot_accumulate_p.def_impl(_reference)
dot_accumulate_p.def_abstract_eval(_abstract)
mlir.register_lowering(dot_accumulate_p, mlir.lower_fun(_reference, multiple_results=False))
triton_lowering.register_lowering(dot_accumulate_p)(_triton)
