"""The safe-gate GPU KDA forward (``gpu_pipeline``; interpret mode on CPU) against the XLA
references.

Shapes are small and share compiles: every T with the same chunk count (64-token chunks) and
the same B, H, K, V reuses one interpret-mode compile (padding happens outside the jit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, naive_recurrent_kda
from pallas_kernels.kda.gpu_config import FEW_SEQUENCE_HEADS, chunk_config, default_inter
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda, gpu_chunk_kda_fused
from pallas_kernels.kda.reference import chunked_kda
from pallas_kernels.kda.triton.intra_blocks import unit_lower_inverse
from pallas_kernels.platform import target
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

B, H, K, V = 2, 2, 32, 64  # K != V on purpose
LB = -5.0


def make_inputs(T: int, seed: int = 0) -> dict[str, jax.Array]:
    return as_f32(kda_case(np.random.default_rng(seed), B, T, H, K, V, LB))


def _ref(x: dict[str, jax.Array], s0: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    return chunked_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K**-0.5, initial_state=s0
    )


@pytest.mark.parametrize("inter", ["fused", "two_pass"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_matches_reference_with_initial_state(T: int, inter: str) -> None:
    x = make_inputs(T, seed=T)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, s = gpu_chunk_kda(*args, initial_state=x["s0"], config=chunk_config(*args[:4], inter=inter))
    ref_o, ref_s = _ref(x, x["s0"])
    assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
    assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
    assert rel(o, ref_o) <= 1e-4
    assert rel(s, ref_s) <= 1e-4


@pytest.mark.parametrize("T", [64, 150])
def test_matches_reference_without_initial_state(T: int) -> None:
    x = make_inputs(T, seed=100 + T)
    o, s = gpu_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    ref_o, ref_s = _ref(x, None)
    assert rel(o, ref_o) <= 1e-4
    assert rel(s, ref_s) <= 1e-4


def test_matches_token_recurrence_at_the_bound() -> None:
    """Every step at the lower bound on half the channels: the largest in-chunk spreads."""
    x = make_inputs(65, seed=7)
    g = jnp.where(jnp.arange(K) % 2 == 0, -4.999, x["g"])
    o, s = gpu_chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["s0"])
    ref_o, ref_s = naive_recurrent_kda(x["q"], x["k"], x["v"], g, x["beta"],
                                       initial_state=x["s0"])
    assert np.isfinite(np.asarray(o)).all()
    assert rel(o, ref_o) <= 1e-4
    assert rel(s, ref_s) <= 1e-4


def test_fused_gate_matches_activated_reference() -> None:
    """In-kernel l2norm / safe-gate sigmoid / beta sigmoid equal the same ops done outside."""
    T = 150
    rng = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v, g_raw, b_logit = f(B, T, H, K), f(B, T, H, K), f(B, T, H, V), f(B, T, H, K), \
        f(B, T, H)
    A_log = jnp.asarray(np.concatenate([rng.uniform(-1, 1, H), np.zeros(3)]), jnp.float32)
    dt_bias = 0.5 * f(H * K)
    s0 = 0.5 * f(B, H, K, V)
    o, s = gpu_chunk_kda_fused(q, k, v, g_raw, b_logit, A_log, dt_bias, lower_bound=LB,
                               initial_state=s0)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    g = LB * jax.nn.sigmoid(jnp.exp(A_log[:H])[:, None] * (g_raw + dt_bias.reshape(H, K)))
    ref_o, ref_s = chunked_kda(l2(q), l2(k), v, g, jax.nn.sigmoid(b_logit), scale=K**-0.5,
                               initial_state=s0)
    assert rel(o, ref_o) <= 1e-4
    assert rel(s, ref_s) <= 1e-4


@pytest.mark.parametrize("T", [1, 65])
def test_bf16_inputs_match_reference(T: int) -> None:
    """bf16 q, k, v: bf16 intermediates (W, U, Qg, Kd, Aqk; X from three bf16 products per fp32
    one) against the fp32 reference on the same rounded inputs. On the H200 the error is 4.0e-3
    for o and 2.7e-3 for the state (fla: 4.1e-3 / 2.8e-3), bf16's own rounding; 2e-2 leaves room
    for small shapes, while a wrong product or mask is off by O(1)."""
    x = make_inputs(T, seed=4)
    q, k, v = (x[n].astype(jnp.bfloat16) for n in ("q", "k", "v"))
    o, s = gpu_chunk_kda(q, k, v, x["g"], x["beta"], initial_state=x["s0"])
    ref_o, ref_s = chunked_kda(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                               x["g"], x["beta"], scale=K**-0.5, initial_state=x["s0"])
    assert o.dtype == jnp.bfloat16
    assert rel(o.astype(jnp.float32), ref_o) <= 2e-2
    assert rel(s, ref_s) <= 2e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_pass_inter_stage_equals_fused(dtype) -> None:
    """The two-pass inter stage (state recurrence, then o for all chunks) stores each chunk's state
    and v_new in the dtype the fused kernel's products round them to, so both give the same o
    and final state up to summation order (fp32: 1e-6; bf16: a few bf16 ulps, 1e-2)."""
    x = make_inputs(150, seed=12)
    q, k, v = (x[n].astype(dtype) for n in ("q", "k", "v"))
    run = lambda inter: gpu_chunk_kda(  # noqa: E731
        q, k, v, x["g"], x["beta"], initial_state=x["s0"],
        config=chunk_config(q, k, v, x["g"], block_v=32, inter=inter))
    (o, s), (o_ref, s_ref) = run("two_pass"), run("fused")
    assert o.dtype == dtype and s.dtype == jnp.float32
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel(o.astype(jnp.float32), o_ref.astype(jnp.float32)) <= tol
    assert rel(s, s_ref) <= tol
    if dtype == jnp.float32:
        ref_o, ref_s = _ref(x, x["s0"])
        assert rel(o, ref_o) <= 1e-4 and rel(s, ref_s) <= 1e-4
    with pytest.raises(ValueError, match=r"^inter: expected one of"):
        chunk_config(q, k, v, x["g"], inter="serial")


@pytest.mark.parametrize("dtype, fused", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_wu_in_loop_equals_wu_kernel(dtype, fused: bool) -> None:
    """The fused inter stage's ``v_new = X (beta v - bk S)`` (Triton) against ``U - W S`` from the
    W/U kernel (the two-pass stage): equal in exact arithmetic, so fp32 agrees to summation order
    (1e-6) and bf16 to a few ulps of its own rounding (1e-2, where a wrong operand is off by
    O(1)); the bf16 case with K3's fused activations (beta from logits inside the loop)."""
    x = make_inputs(150, seed=21)
    q, k, v = (x[n].astype(dtype) for n in ("q", "k", "v"))
    A_log, dt_bias = jnp.linspace(-1.0, 1.0, H), jnp.linspace(-0.5, 0.5, H * K)

    def run(inter: str) -> tuple[jax.Array, jax.Array]:
        config = chunk_config(q, k, v, x["g"], inter=inter, inter_kernel="triton")
        if fused:
            return gpu_chunk_kda_fused(q, k, v, x["g"], x["beta"], A_log, dt_bias, lower_bound=LB,
                                       initial_state=x["s0"], config=config)
        return gpu_chunk_kda(q, k, v, x["g"], x["beta"], initial_state=x["s0"], config=config)

    (o, s), (o_ref, s_ref) = run("fused"), run("two_pass")
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel(o.astype(jnp.float32), o_ref.astype(jnp.float32)) <= tol
    assert rel(s, s_ref) <= tol
    if not fused:
        ref_o, ref_s = _ref(x, x["s0"])
        assert rel(o, ref_o) <= 1e-4 and rel(s, ref_s) <= 1e-4


@pytest.mark.parametrize("heads, kernels", [(2, ("kda_states", "kda_output")),
                                            (FEW_SEQUENCE_HEADS, ("kda_inter_state",))])
def test_default_inter_stage_by_sequence_heads(heads: int, kernels: tuple[str, ...]) -> None:
    """Without ``inter``, few (sequence, head) pairs take the two-pass stage and many the fused
    kernel (``default_inter``), with their block_v, warps and pipeline stages (``chunk_config``):
    checked on the Triton IR lowered for an abstract H200 (no GPU needed)."""
    f = jax.ShapeDtypeStruct
    T, K16 = 64, 16
    args = (f((1, T, heads, K16), jnp.bfloat16),) * 2 + (f((1, T, heads, 128), jnp.bfloat16),
                                                        f((1, T, heads, K16), jnp.float32),
                                                        f((1, T, heads), jnp.float32))
    text = lowered_for_h200(lambda *a: gpu_chunk_kda(*a), *args)
    inter, block_v, warps = default_inter(heads)
    assert (inter, block_v, warps) == (("two_pass", 16, 4) if heads < FEW_SEQUENCE_HEADS
                                       else ("fused", 64, 4))
    config = chunk_config(*args[:4])
    assert (config.inter, config.block_v, config.num_warps) == (inter, block_v, warps)
    # pairs and inverse, then the W/U kernel unless the fused inter stage forms W and U itself
    assert text.count("stablehlo.custom_call @__gpu") == 2 + (inter == "two_pass") + len(kernels)
    lines = {name: next(x for x in text.splitlines() if f'name = "{name}"' in x) for name in kernels}
    assert all(f"num_warps = {warps} " in line for line in lines.values())
    stages = config.num_stages
    assert stages == (1 if inter == "fused" else 2)
    assert all(f"num_stages = {stages} " in line for line in lines.values())
    # the recurrence (first listed): one program per V block in the grid's z
    assert f"grid_z = {128 // block_v} " in lines[kernels[0]]


def test_block_inverse() -> None:
    """``unit_lower_inverse`` (16x16 blocks, IEEE fp32 products) against numpy's inverse of
    I + L, for an L like the kernel's (strictly lower, entries of beta k_r . k_i e^{G_r - G_i}: at
    most 1 in size). Its bf16 tensor-core mode (``chunk_math.BF16X3``, for a bf16 X) is split into
    bf16 products by the Triton lowering only: XLA on CPU computes that preset in fp32, so its
    precision is checked on the GPU (``benchmarks/kda_pallas_h200.py``: o within 4.02e-3 of the
    fp32 reference with it, as with IEEE products)."""
    rng = np.random.default_rng(0)
    kk = rng.standard_normal((64, 16))
    kk /= np.linalg.norm(kk, axis=1, keepdims=True)
    decay = np.exp(-0.05 * np.subtract.outer(np.arange(64), np.arange(64)).clip(0))
    L = np.tril(rng.uniform(0, 1, (64, 1)) * (kk @ kk.T) * decay, -1).astype(np.float32)
    blocks = {(i, j): jnp.asarray(L[16 * i:16 * i + 16, 16 * j:16 * j + 16])
              for i in range(4) for j in range(i + 1)}
    got = np.zeros((64, 64))
    order = []

    def put(i: int, j: int, blk: jax.Array) -> None:
        order.append((i, j))
        got[16 * i:16 * i + 16, 16 * j:16 * j + 16] = np.asarray(blk)

    unit_lower_inverse(lambda i, j: blocks[i, j], put)
    # every block of X once, column by column (what keeps the kernel's registers to one column)
    assert order == [(i, j) for j in range(4) for i in range(j, 4)]
    want = np.linalg.inv(np.eye(64) + L.astype(np.float64))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-6


def test_api_dispatch() -> None:
    x = make_inputs(65, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, s = chunk_kda(*args, initial_state=x["s0"], output_final_state=True,
                     implementation="pallas_gpu", lower_bound=LB)
    ref_o, ref_s = chunk_kda(*args, initial_state=x["s0"], output_final_state=True,
                             implementation="xla")
    assert rel(o, ref_o) <= 1e-4 and rel(s, ref_s) <= 1e-4
    with pytest.raises(NotImplementedError, match="unbounded gate"):
        chunk_kda(*args, implementation="pallas_gpu")
    with pytest.raises(NotImplementedError, match="unbounded gate"):
        chunk_kda(*args, implementation="pallas_gpu", lower_bound=-6.0)
    # the policy keeps the XLA reference off GPU (tests/pallas_kernels/kda/test_backends.py)
    auto = chunk_kda(*args, lower_bound=LB)[0]
    assert auto.shape == (B, 65, H, V)


def test_gpu_path_validates_shapes() -> None:
    """The Triton lowering needs power-of-two K and V >= 16; checked before any compile."""
    z = jnp.zeros((1, 8, 1, 24), jnp.float32)
    with pytest.raises(ValueError, match="powers of two"), target("gpu"):
        gpu_chunk_kda(z, z, z, z, z[..., 0])
    with pytest.raises(ValueError, match="^block_v"):
        chunk_config(z, z, z, z, block_v=24)
    with pytest.raises(ValueError, match="^lower_bound"):
        gpu_chunk_kda_fused(z, z, z, z, z[..., 0], jnp.zeros(1), jnp.zeros(24), lower_bound=-6.0)


def test_pallas_path_is_differentiable() -> None:
    """chunk_kda(implementation="pallas_gpu") has a custom VJP (the analytic GPU backward): its
    gradients for every input equal those of the XLA path (same function; fp32 rounding only)."""
    x = make_inputs(70, seed=7)
    cot = jax.random.normal(jax.random.key(0), x["v"].shape)

    def loss(implementation, q, k, v, g, beta, s0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                         implementation=implementation, lower_bound=LB)
        return jnp.sum(o * cot) + jnp.sum(s * s0)

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"])
    grads = jax.grad(lambda *a: loss("pallas_gpu", *a), argnums=range(6))(*args)
    expected = jax.grad(lambda *a: loss("xla", *a), argnums=range(6))(*args)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "s0"), grads, expected):
        assert rel(got, want) <= 1e-5, name
