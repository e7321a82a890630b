"""The MXFP4 Mosaic GPU gate+up kernel (pallas_kernels/moe/mosaic_gpu/gate_up_mxfp4.py) on the CPU.

The kernel's decode is PTX and runs only on Hopper (benchmarks/moe_mxfp4_mgpu.py checks the kernel
against the bf16 kernel there). Here: the shipped PTX text is executed by a small interpreter over
every code and the thread's register order, and must reproduce the release decoder exactly once
the columns are put back through ``x_column_order``; the scale factors are exact powers of two;
bad operands are refused; the kernel lowers for an H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.moe import pallas_gpu
from pallas_kernels.moe.mosaic_gpu import gate_up_mxfp4 as mx
from pallas_kernels.mxfp4 import MXFP4Experts, decode_mxfp4_jax
from tests.pallas_kernels.h200_lowering import lowered_for_h200

S = jax.ShapeDtypeStruct
_U8, _BF16 = jnp.uint8, jnp.bfloat16


def _bf16_pair(word: np.ndarray) -> np.ndarray:
    """uint32 words -> [..., 2] float32 of their (low, high) bf16 halves."""
    halves = np.stack([word & 0xFFFF, word >> 16], axis=-1).astype(np.uint16)
    return halves.view(ml_dtypes.bfloat16).astype(np.float32)


def _run_pair_ptx(codes: np.ndarray, factor_pair: np.ndarray) -> list[np.ndarray]:
    """Executes ``_pair_ptx()`` on uint32 ``codes`` ($4) and bf16x2 ``factor_pair`` ($5) words,
    returning $0..$3 as [..., 2] float32 (low, high). Knows the instructions the decode uses."""
    regs: dict[str, np.ndarray] = {"$4": codes.astype(np.uint32), "$5": factor_pair.astype(np.uint32)}
    value = lambda name: regs[name] if name in regs else np.uint32(int(name, 0))  # noqa: E731
    for line in mx._pair_ptx().splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [a.strip() for a in rest.split(",")]
        a = value(src[0])
        if op == "shl.b32":
            regs[dst] = (a << np.uint32(int(src[1]))).astype(np.uint32)
        elif op == "shr.b32":
            regs[dst] = (a >> np.uint32(int(src[1]))).astype(np.uint32)
        elif op == "mul.lo.u32":
            regs[dst] = (a.astype(np.uint64) * int(src[1], 0) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "and.b32":
            regs[dst] = a & value(src[1])
        elif op == "mov.b32":
            regs[dst] = a.copy()
        elif op == "lop3.b32":
            b, c, lut = value(src[1]), value(src[2]), int(src[3], 0)
            out = np.zeros_like(a)
            for bit in range(8):  # lop3: bit i of the table is f(a, b, c) at a=0xF0, b=0xCC, c=0xAA
                if lut >> bit & 1:
                    sel_a = a if bit & 4 else ~a
                    sel_b = b if bit & 2 else ~b
                    sel_c = c if bit & 1 else ~c
                    out |= sel_a & sel_b & sel_c
            regs[dst] = out.astype(np.uint32)
        elif op == "mul.rn.bf16x2":
            product = _bf16_pair(a) * _bf16_pair(value(src[1]))  # powers of two: exact
            bits = product.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
            regs[dst] = bits[..., 0] | (bits[..., 1] << 16)
        else:
            raise AssertionError(f"the interpreter does not know {op}")
    return [_bf16_pair(regs[f"${j}"]) for j in range(4)]


def _kernel_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the kernel's registers hold for weights [R, K] (packed [R, K/2], scale [R, K/32]),
    as [R, K] in wgmma column order: thread t's 32-bit word of 16-byte block c is bytes
    16 c + 4 t .. + 3 of the row; pair j of it fills wgmma columns 8 j + 2 t (+1) of the block's
    32 (``_decoder``), times the row's factor for the block."""
    rows, half = packed.shape
    factors = np.asarray(mx.scale_multipliers(jnp.asarray(scale)[None]))[0].T  # [R, K/32] bf16
    out = np.zeros((rows, 2 * half), np.float32)
    for block in range(half // 16):
        f16 = factors[:, block].astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        f2 = f16 | (f16 << 16)
        for t in range(4):
            word = packed[:, 16 * block + 4 * t:16 * block + 4 * t + 4].copy().view("<u4")[:, 0]
            for j, pair in enumerate(_run_pair_ptx(word, f2)):
                col = 32 * block + 8 * j + 2 * t
                out[:, col:col + 2] = pair
    return out


def test_decode_ptx_reproduces_the_release_decoder_in_column_order():
    rng = np.random.default_rng(0)
    rows, k = 24, 3 * mx.STEP_K
    packed = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    packed[0, :16] = np.arange(16) | (np.arange(16)[::-1] << 4)  # every code in both nibbles
    scale = rng.integers(mx.SCALE_MIN, mx.SCALE_MAX + 1, (rows, k // 32), dtype=np.uint8)
    scale[1, :2] = (mx.SCALE_MIN, mx.SCALE_MAX)  # the range's ends: still exact
    want = np.asarray(decode_mxfp4_jax(jnp.asarray(packed), jnp.asarray(scale), jnp.float32))
    got = _kernel_decode(packed, scale) * 2.0 ** mx.FOLD  # the epilogue's scaling back
    order = mx.x_column_order(k)
    np.testing.assert_array_equal(got, want[:, order])  # wgmma column p holds weight column order[p]


def test_x_column_order_permutes_within_each_scale_block():
    k = 4 * mx.STEP_K
    order = mx.x_column_order(k)
    assert sorted(order.tolist()) == list(range(k))
    np.testing.assert_array_equal(order // 32, np.arange(k) // 32)  # a factor per 32 columns holds
    with pytest.raises(ValueError, match="multiple of"):
        mx.x_column_order(mx.STEP_K + 64)


def test_scale_multipliers_are_exact_powers_of_two_and_clamped():
    scale = np.arange(256, dtype=np.uint8).reshape(1, 2, 128)  # [E, N, K/32]
    got = np.asarray(mx.scale_multipliers(jnp.asarray(scale)).astype(jnp.float32))
    assert got.shape == (1, 128, 2)  # [E, K/32, N]
    clamped = np.clip(scale.astype(np.float64), mx.SCALE_MIN, mx.SCALE_MAX)
    want = np.exp2(clamped - 127 + 126 - mx.FOLD)
    np.testing.assert_array_equal(got, np.swapaxes(want, 1, 2).astype(np.float32))


def _operands(m=256, e=4, n=256, k=256, packed_dtype=_U8):
    return (S((m, k), _BF16), S((e, n, k // 2), packed_dtype), S((e, n, k // 32), _U8),
            S((e, n, k // 2), packed_dtype), S((e, n, k // 32), _U8), S((e,), jnp.int32))


@pytest.mark.parametrize("kwargs", [dict(k=320), dict(n=192), dict(packed_dtype=jnp.int8)])
def test_rejects_operands_it_cannot_take(kwargs):
    with pytest.raises(ValueError, match="gate_up_situ_mxfp4_mgpu"):
        jax.eval_shape(mx.gate_up_situ_mxfp4_mgpu, *_operands(**kwargs))


def test_lowers_for_h200():
    text = lowered_for_h200(lambda *a: mx.gate_up_situ_mxfp4_mgpu(*a), *_operands(m=300))
    assert "k3_moe_gate_up_situ_mxfp4_mgpu" in text


def _packed(e: int, n: int, k: int):
    return MXFP4Experts(S((e, n, k // 2), _U8), S((e, n, k // 32), _U8))


@pytest.mark.parametrize("experts, on_mosaic", [(28, True), (112, False)])
def test_expert_mlp_takes_packed_gate_up_for_large_groups(experts: int, on_mosaic: bool):
    """The routed experts' forward and gradient on the GPU (lowered for an abstract H200, K3 widths,
    16384 rows) with packed weights: this kernel for gate+up where the bf16 kernels would be Mosaic
    GPU's (28 experts), the Triton kernels at 112; the backward decodes the packed weights in XLA."""
    m, d, f = 16384, 3584, 3072
    w1, w2, w3 = _packed(experts, f, d), _packed(experts, d, f), _packed(experts, f, d)

    def loss(rows, gs, w1, w2, w3):
        out = pallas_gpu.grouped_mlp(rows, gs, w1, w2, w3, beta=4.0, linear_beta=25.0)
        return out.astype(jnp.float32).sum()

    args = (S((m, d), _BF16), S((experts,), jnp.int32), w1, w2, w3)
    text = lowered_for_h200(jax.value_and_grad(loss), *args)  # the value keeps the forward
    assert ("k3_moe_gate_up_situ_mxfp4_mgpu" in text) == on_mosaic


def _plan(rows: int, experts: int, *, d: int = 3584, f: int = 3072, interpret: bool = False):
    return pallas_gpu.plan_kernels(dtype=_BF16, weight_dtype=None, packed=True, num_rows=rows,
                                   num_experts=experts, d_in=d, hidden=f, d_out=d, interpret=interpret)


def test_plan_keeps_gate_up_packed_only_where_the_kernel_runs():
    """MXFP4 gate and up stay packed for this kernel at large groups (w2 decoded, its down product on
    Mosaic GPU), for the Triton tile decode at decode sizes (all three packed), and are decoded first
    for small groups, for K not a multiple of STEP_K, and in the interpreter; the backward recomputes
    gate and up from what the forward got."""
    large = _plan(16384, 28)
    assert (large.gate_up, large.packed_gate_up, large.packed_down, large.down) == (
        "mosaic_gpu_mxfp4", True, False, "mosaic_gpu")
    assert (large.recompute, large.dh, large.dx) == ("triton", "mosaic_gpu", "mosaic_gpu")
    decode = _plan(256, 28)
    assert (decode.gate_up, decode.down, decode.packed_gate_up, decode.packed_down) == (
        "triton", "triton", True, True)
    small = _plan(4096, 28)
    assert (small.gate_up, small.packed_gate_up, small.packed_down) == ("mosaic_gpu", False, False)
    odd = _plan(16384, 28, d=3520)  # K not a multiple of STEP_K
    assert (odd.gate_up, odd.packed_gate_up) == ("mosaic_gpu", False)
    interpreted = _plan(16384, 28, interpret=True)
    assert (interpreted.gate_up, interpreted.packed_gate_up) == ("triton", False)
