"""pallas_kernels/triton_dot.py: ``acc + a @ b`` as one Triton dot.

Values: the primitive against numpy for every transpose and precision, eagerly, under jit and
inside an interpreted Pallas kernel. Lowering: the grouped GEMM's Triton IR for an H200 has its
accumulators inside the dots (``tt.dot a, b, %acc``) and no ``arith.addf`` of a dot result, the
pattern that leaves the wgmma synchronous (see the module docstring).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.moe import pallas_grouped_gemm as pg
from pallas_kernels.triton_dot import dot_accumulate


def _operands(trans_a: bool, trans_b: bool, dtype=jnp.float32):
    r = np.random.default_rng(int(trans_a) * 2 + int(trans_b))
    m, k, n = 16, 32, 24
    acc = r.standard_normal((m, n)).astype(np.float32)
    a = r.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = r.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    want = acc.astype(np.float64) + (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b)
    return jnp.asarray(acc), jnp.asarray(a, dtype), jnp.asarray(b, dtype), want


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matches_numpy_eager_and_jit(trans_a: bool, trans_b: bool) -> None:
    acc, a, b, want = _operands(trans_a, trans_b)
    fn = functools.partial(dot_accumulate, trans_a=trans_a, trans_b=trans_b, precision="ieee")
    for got in (fn(acc, a, b), jax.jit(fn)(acc, a, b)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)  # fp32 rounding of a 32-term sum


def test_bf16_operands_accumulate_in_fp32() -> None:
    acc, a, b, _ = _operands(False, True, jnp.bfloat16)
    want = np.asarray(acc, np.float64) + np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    got = dot_accumulate(acc, a, b, trans_b=True)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)  # bf16 products are exact in fp32


def test_inside_an_interpreted_pallas_loop() -> None:
    """A k loop accumulating through the primitive, as the GEMM kernels use it."""
    r = np.random.default_rng(0)
    a = r.standard_normal((32, 64)).astype(np.float32)
    b = r.standard_normal((64, 16)).astype(np.float32)

    def kernel(a_ref, b_ref, o_ref):
        def body(k, acc):
            ks = pl.ds(k * 16, 16)
            return dot_accumulate(acc, a_ref[:, ks], b_ref[ks, :], precision="ieee")

        o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros((32, 16), jnp.float32))

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32, 16), jnp.float32), interpret=True)(a, b)
    np.testing.assert_allclose(np.asarray(got), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("args", "message"), [
    ((jnp.zeros((4, 4)), jnp.zeros((4, 8)), jnp.zeros((8, 4), jnp.bfloat16)), "one dtype"),
    ((jnp.zeros((4, 5)), jnp.zeros((4, 8)), jnp.zeros((8, 4))), "want fp32 \\[4, 4\\]"),
    ((jnp.zeros((4, 4), jnp.bfloat16), jnp.zeros((4, 8)), jnp.zeros((8, 4))), "want fp32"),
])
def test_bad_operands_are_named(args, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dot_accumulate(*args)


def test_tf32_precision_needs_fp32_operands() -> None:
    with pytest.raises(ValueError, match="fp32 operands"):
        dot_accumulate(jnp.zeros((4, 4)), jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 4), jnp.bfloat16),
                       precision="tf32")


def _triton_ir(fn, *args) -> list[str]:
    """Triton IR text of each pallas_call in fn(*args), lowered for CUDA (the modules are MLIR bytecode)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    texts: list[str] = []

    def collect(op):
        if op.name == "stablehlo.custom_call" and "__gpu$xla.gpu.triton" in str(op.attributes["call_target_name"]):
            context = mlir.make_ir_context()
            tt_dialect.register_dialect(context)
            with context:
                kernel = ir.Module.parse(op.attributes["mhlo.backend_config"]["ir"].value_bytes)
                texts.append(kernel.operation.get_asm(enable_debug_info=False))
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    return texts


def test_grouped_gemm_accumulates_inside_the_dot(h200_triton: None) -> None:
    sds = jax.ShapeDtypeStruct
    w = sds((8, 256, 512), jnp.bfloat16)
    texts = _triton_ir(functools.partial(pg.grouped_gate_up_situ, cfg=pg.GATE_UP_DEFAULT),
                       sds((1024, 512), jnp.bfloat16), w, w, sds((8,), jnp.int32))
    assert len(texts) == 1
    dots = re.findall(r"(%\w+) = tt\.dot %\w+, %\w+, (%[\w#]+)", texts[0])
    assert len(dots) == 2  # gate and up
    assert all(acc.startswith("%arg") for _, acc in dots), dots  # the loop-carried accumulators
    results = {name for name, _ in dots}
    added = re.findall(r"arith\.addf (%\w+), (%\w+)", texts[0])
    assert not [pair for pair in added if results & set(pair)], added
