"""Mosaic TPU grouped gate+up+SiTU under the TPU interpreter (CPU, race detection on) vs the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moe.mosaic_tpu.grouped_gemm import make_schedule, tpu_grouped_gate_up_situ, tpu_grouped_matmul
from pallas_kernels.moe.reference import situ

INTERP = pltpu.InterpretParams(detect_races=True)
_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def _reference(x, w1, w3, gs, beta=4.0, linear_beta=25.0):
    def grouped(w):
        return jax.lax.ragged_dot_general(x, w, gs, _DIMS, preferred_element_type=jnp.float32).astype(x.dtype)

    return situ(grouped(w1), grouped(w3), beta, linear_beta)


def _numpy_reference(x, w1, w3, gs, beta=4.0, lb=25.0):
    x, w1, w3 = (np.asarray(a, np.float64) for a in (x, w1, w3))
    out = np.zeros((x.shape[0], w1.shape[1]))
    s = 0
    for e, n in enumerate(np.asarray(gs)):
        g, u = x[s:s + n] @ w1[e].T, x[s:s + n] @ w3[e].T
        out[s:s + n] = beta * np.tanh(g / beta) / (1 + np.exp(-g)) * lb * np.tanh(u / lb)
        s += n
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _no_races():
    return _tpu_interp.races is not None and not _tpu_interp.races.races_found


def _inputs(M, E, D, F, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, D)), dtype)
    w1 = jnp.asarray(rng.standard_normal((E, F, D)) * D ** -0.5 * 3, dtype)
    w3 = jnp.asarray(rng.standard_normal((E, F, D)) * D ** -0.5 * 3, dtype)
    return x, w1, w3


@pytest.mark.parametrize("gs,bm", [((37, 0, 45, 18), 16), ((37, 0, 45, 18), 32), ((0, 100, 0, 0), 16),
                                   ((5, 11, 0, 60), 32)])
def test_matches_reference_fp32(gs, bm):
    M, E, D, F = 100, 4, 256, 256
    x, w1, w3 = _inputs(M, E, D, F, seed=sum(gs) + bm)
    gsa = jnp.asarray(gs, jnp.int32)
    out = tpu_grouped_gate_up_situ(x, w1, w3, gsa, block_m=bm, block_n=128, block_k=128, interpret=INTERP)
    assert out.shape == (M, F) and out.dtype == jnp.float32
    assert _no_races()
    ref = _reference(x, w1, w3, gsa)
    assert _rel(out, ref) <= 1e-5
    assert _rel(out, _numpy_reference(x, w1, w3, gs)) <= 1e-5
    tail = sum(gs)
    if tail < M:  # rows past sum(group_sizes) are zero, as in ragged_dot
        assert np.all(np.asarray(out[tail:]) == 0)


def test_default_blocks_single_tile_bf16():
    M, E, D, F = 40, 3, 256, 256
    x, w1, w3 = _inputs(M, E, D, F, seed=3, dtype=jnp.bfloat16)
    gs = jnp.asarray([10, 0, 30], jnp.int32)
    out = tpu_grouped_gate_up_situ(x, w1, w3, gs, block_m=16, interpret=INTERP)
    assert out.dtype == jnp.bfloat16 and _no_races()
    assert _rel(out, _numpy_reference(x, w1, w3, [10, 0, 30])) <= 2e-2


def test_schedule_items():
    s = make_schedule(jnp.asarray([37, 0, 45, 18], jnp.int32), 112, 16)
    tile, flags = np.asarray(s.tile), np.asarray(s.flags)
    active = (flags & 4) != 0
    assert np.all(np.diff(tile) >= 0)  # nondecreasing: output blocks stay resident per tile
    assert sorted(set(tile[active])) == list(range(7))  # every row tile visited
    assert int(active.sum()) == 3 + 4 + 2 + 1  # 0..2 | 2..5 | 5..6 | virtual padding rows 100..111


def test_two_cores_and_tiny_m():
    """F tiles are 'parallel': two simulated TensorCores, race detection on; M < block_m pads rows."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    x, w1, w3 = _inputs(100, 4, 256, 256, seed=11)
    gs = [37, 0, 45, 18]
    out = tpu_grouped_gate_up_situ(x, w1, w3, jnp.asarray(gs, jnp.int32), block_m=16, block_n=128, block_k=128,
                                   interpret=params)
    assert _no_races() and _rel(out, _numpy_reference(x, w1, w3, gs)) <= 1e-5
    x5 = x[:5]
    out = tpu_grouped_gate_up_situ(x5, w1, w3, jnp.asarray([2, 0, 3, 0], jnp.int32), block_m=16, block_n=128,
                                   block_k=128, interpret=params)
    assert out.shape == (5, 256) and _no_races()
    assert _rel(out, _numpy_reference(x5, w1, w3, [2, 0, 3, 0])) <= 1e-5


def test_bad_blocks():
    x, w1, w3 = _inputs(16, 2, 256, 256, seed=0)
    with pytest.raises(ValueError):
        tpu_grouped_gate_up_situ(x, w1, w3, jnp.asarray([8, 8], jnp.int32), block_n=64, interpret=INTERP)


def test_lowers_to_mosaic_tpu():
    """Cross-lowering for TPU on CPU: the Pallas -> Mosaic MLIR step succeeds (no libtpu compile)."""
    f = jax.ShapeDtypeStruct
    args = (f((100, 256), jnp.bfloat16), f((4, 512, 256), jnp.bfloat16), f((4, 512, 256), jnp.bfloat16),
            f((4,), jnp.int32))
    lowered = jax.jit(lambda *a: tpu_grouped_gate_up_situ(*a, block_m=32)).trace(*args).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
    down = (f((100, 512), jnp.bfloat16), f((4, 256, 512), jnp.bfloat16), f((4,), jnp.int32))
    lowered = jax.jit(lambda *a: tpu_grouped_matmul(*a, block_m=32)).trace(*down).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def _numpy_grouped_matmul(x, w, gs):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, s = np.zeros((x.shape[0], w.shape[1])), 0
    for e, n in enumerate(gs):
        out[s:s + n] = x[s:s + n] @ w[e].T
        s += n
    return out


@pytest.mark.parametrize("gs,bm", [((37, 0, 45, 18), 16), ((0, 100, 0, 0), 32), ((5, 11, 0, 60), 16),
                                   ((0, 0, 0, 0), 16)])
def test_grouped_matmul_matches_reference(gs, bm):
    """The down projection's kernel: fp32 within 1e-5 of float64 (products and sums in fp32, other
    order), rows past sum(group_sizes) exactly zero, empty experts and an all-empty batch included,
    race detection on with two simulated cores."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    rng = np.random.default_rng(sum(gs) + bm)
    M, E, K, N = 100, 4, 256, 384
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, N, K)) / 16, jnp.float32)
    out = tpu_grouped_matmul(x, w, jnp.asarray(gs, jnp.int32), block_m=bm, block_n=128, block_k=128,
                             precision=jax.lax.Precision.HIGHEST, interpret=params)
    assert out.shape == (M, N) and out.dtype == jnp.float32 and _no_races()
    tail = sum(gs)
    if tail:
        assert _rel(out[:tail], _numpy_grouped_matmul(x, w, gs)[:tail]) <= 1e-5
    assert np.all(np.asarray(out[tail:]) == 0)


def test_grouped_matmul_bf16_default_tiles():
    """bf16 in and out at the default tiles: the error is the output's bf16 rounding (2^-9 relative)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((40, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 256, 512)) / 16, jnp.bfloat16)
    out = tpu_grouped_matmul(x, w, jnp.asarray([10, 0, 30], jnp.int32), block_m=16, interpret=INTERP)
    assert out.dtype == jnp.bfloat16 and _no_races()
    assert _rel(out, _numpy_grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), [10, 0, 30])) <= 5e-3


def test_grouped_matmul_shape_errors_name_the_weight():
    x = jnp.zeros((16, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"w \[E, out, in\]"):
        tpu_grouped_matmul(x, jnp.zeros((2, 128, 128)), jnp.asarray([8, 8], jnp.int32), interpret=INTERP)
    with pytest.raises(ValueError, match="group_sizes must be"):
        tpu_grouped_matmul(x, jnp.zeros((2, 128, 256)), jnp.asarray([16], jnp.int32), interpret=INTERP)


def test_tpu_kernels_run_the_routed_experts(monkeypatch):
    """routed_experts(implementation="mosaic_tpu") on CPU (the TPU interpreter): both Mosaic-TPU kernels
    (gate+up+SiTU, down) in the routed path, against the XLA path (fp32: same products, other order,
    1e-5)."""
    import functools

    from pallas_kernels.moe import api
    from pallas_kernels.moe.mosaic_tpu import experts as mt

    calls = []
    for name in ("tpu_grouped_gate_up_situ", "tpu_grouped_matmul"):
        real = getattr(mt, name)

        def counted(*a, real=real, name=name, **kw):
            calls.append(name)
            return real(*a, **kw, block_m=16)

        monkeypatch.setattr(mt, name, counted)
    rng = np.random.default_rng(3)
    n, k, e, d_in, f = 24, 2, 4, 256, 256
    x = jnp.asarray(rng.standard_normal((n, d_in)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.standard_normal((e, f, d_in)) / 16, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((e, d_in, f)) / 16, jnp.float32)
    ids = jnp.asarray(rng.integers(0, e - 1, (n, k)), jnp.int32)  # expert e-1 gets no rows
    weights = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    run = functools.partial(api.routed_experts, x, w1, w2, w3, weights, ids, beta=4.0, linear_beta=25.0)
    want = run(implementation="xla")
    got = run(implementation="mosaic_tpu")
    assert calls == ["tpu_grouped_gate_up_situ", "tpu_grouped_matmul"]
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-5
    # differentiable: the reference's VJP (same function, so the gradients agree to the same level)
    ct = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)

    def grads(impl):
        loss = lambda *a: jnp.sum(api.routed_experts(*a, weights, ids, beta=4.0, linear_beta=25.0,  # noqa: E731
                                                     implementation=impl) * ct)
        return jax.grad(loss, (0, 1, 2, 3))(x, w1, w2, w3)

    for g, w in zip(grads("mosaic_tpu"), grads("xla"), strict=True):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) <= 1e-5
