"""Mosaic TPU chunked KDA forward under the TPU interpreter (CPU, race detection on) vs the fp32
references, batched and packed (cu_seqlens); chunk_kda(implementation="mosaic_tpu") runs it in TPU
interpret mode on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.mosaic_tpu.chunk import tpu_chunk_kda
from pallas_kernels.kda.reference import chunked_kda, naive_recurrent_kda
from pallas_kernels.platform import target
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

INTERP = pltpu.InterpretParams(detect_races=True)
B, H, K, V = 2, 2, 32, 64  # K != V on purpose
LB = -5.0


def make_inputs(T: int, seed: int, batch: int = B) -> dict[str, jax.Array]:
    return as_f32(kda_case(np.random.default_rng(seed), batch, T, H, K, V, LB))


def _no_races() -> bool:
    return _tpu_interp.races is not None and not _tpu_interp.races.races_found


def _args(x: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_matches_reference_with_initial_state(T: int) -> None:
    x = make_inputs(T, seed=T)
    o, s = tpu_chunk_kda(*_args(x), initial_state=x["s0"], interpret=INTERP)
    ref_o, ref_s = chunked_kda(*_args(x), scale=K**-0.5, initial_state=x["s0"])
    assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
    assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5
    assert _no_races()


def test_without_initial_state_and_custom_scale() -> None:
    x = make_inputs(64, seed=3)
    o, s = tpu_chunk_kda(*_args(x), scale=0.3, interpret=INTERP)
    ref_o, ref_s = chunked_kda(*_args(x), scale=0.3, initial_state=None)
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5


def test_at_the_bound_matches_token_recurrence() -> None:
    """Every step at the lower bound on half the channels: the largest in-chunk spreads, the
    largest midpoint factors (e^35 .. e^40); still finite and exact."""
    x = make_inputs(130, seed=7)
    g = jnp.where(jnp.arange(K) % 2 == 0, -4.999, x["g"])
    o, s = tpu_chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["s0"],
                         interpret=INTERP)
    ref_o, ref_s = naive_recurrent_kda(x["q"], x["k"], x["v"], g, x["beta"],
                                       initial_state=x["s0"])
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5


def test_correlated_keys_stay_exact() -> None:
    """Nearly identical keys and beta near 1 within a chunk: (I + L) is far from the identity and
    a whole-chunk Neumann series would cancel catastrophically; the block doubling does not."""
    x = make_inputs(64, seed=11, batch=1)
    k = x["k"][:, :1] + 0.05 * x["k"]
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = jnp.full_like(x["g"], -0.01)
    beta = jnp.full_like(x["beta"], 0.95)
    o, s = tpu_chunk_kda(x["q"], k, x["v"], g, beta, initial_state=x["s0"], interpret=INTERP)
    ref_o, ref_s = naive_recurrent_kda(x["q"], k, x["v"], g, beta, initial_state=x["s0"])
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5


def test_bf16_inputs() -> None:
    x = make_inputs(70, seed=8)
    qb, kb, vb = (x[n].astype(jnp.bfloat16) for n in ("q", "k", "v"))
    o, s = tpu_chunk_kda(qb, kb, vb, x["g"], x["beta"], initial_state=x["s0"], interpret=INTERP)
    ref_o, ref_s = chunked_kda(qb, kb, vb, x["g"], x["beta"], scale=K**-0.5,
                               initial_state=x["s0"])
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel(s, ref_s) <= 1e-5 and rel(o, ref_o) <= 1e-2


def test_two_cores_race_free() -> None:
    """The (B * H) axis is parallel: split it over two simulated TensorCores, race detection on."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    x = make_inputs(100, seed=5)
    o, s = tpu_chunk_kda(*_args(x), initial_state=x["s0"], interpret=params)
    ref_o, ref_s = chunked_kda(*_args(x), scale=K**-0.5, initial_state=x["s0"])
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5
    assert _no_races()


def packed(lens: tuple[int, ...], seed: int) -> tuple[dict[str, jax.Array], np.ndarray]:
    """Packed [1, T, ...] inputs with per-sequence initial states [N, H, K, V]."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = make_inputs(int(cu[-1]), seed=seed, batch=1)
    x["s0"] = make_inputs(1, seed=seed + 1, batch=len(lens))["s0"]
    return x, cu


@pytest.mark.parametrize("lens", [(1, 63, 64, 65, 130), (130, 0, 1), (5,)])
def test_packed_sequences_match_reference(lens: tuple[int, ...]) -> None:
    x, cu = packed(lens, seed=sum(lens))
    o, s = tpu_chunk_kda(*_args(x), initial_state=x["s0"], cu_seqlens=cu, interpret=INTERP)
    ref_o, ref_s = chunked_kda(*_args(x), scale=K**-0.5, initial_state=x["s0"], cu_seqlens=cu)
    assert o.shape == (1, cu[-1], H, V) and s.shape == (len(lens), H, K, V)
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5
    assert _no_races()


def test_packed_sequences_equal_separate_runs() -> None:
    """No state crosses a boundary: each packed sequence's output and state are its own run's."""
    lens = (70, 1, 64, 3)
    x, cu = packed(lens, seed=21)
    o, s = tpu_chunk_kda(*_args(x), initial_state=x["s0"], cu_seqlens=cu, interpret=INTERP)
    for i in range(len(lens)):
        piece = [a[:, cu[i]:cu[i + 1]] for a in _args(x)]
        o_i, s_i = tpu_chunk_kda(*piece, initial_state=x["s0"][i:i + 1], interpret=INTERP)
        assert rel(o[:, cu[i]:cu[i + 1]], o_i) <= 1e-6, i
        assert rel(s[i], s_i[0]) <= 1e-6, i


def test_validation() -> None:
    x = make_inputs(8, seed=0)
    with pytest.raises(ValueError, match=r"^beta: expected shape \(2, 8, 2\)"):
        tpu_chunk_kda(*_args(x)[:4], x["beta"][:, :, :1], interpret=INTERP)
    with pytest.raises(ValueError, match=r"^initial_state: expected shape"):
        tpu_chunk_kda(*_args(x), initial_state=x["s0"][:1], interpret=INTERP)
    with pytest.raises(ValueError, match=r"^cu_seqlens:.*B == 1"):
        tpu_chunk_kda(*_args(x), cu_seqlens=np.array([0, 8]), interpret=INTERP)
    one = [a[:1] for a in _args(x)]
    with pytest.raises(ValueError, match=r"^initial_state: .*\[N, H, K, V\]"):
        tpu_chunk_kda(*one, initial_state=x["s0"][:1], cu_seqlens=np.array([0, 3, 8]),
                      interpret=INTERP)


def test_lowers_to_mosaic_tpu() -> None:
    """Cross-lowering for TPU on CPU at K3's head size: the Pallas -> Mosaic MLIR step succeeds
    (no libtpu compile)."""
    f = jax.ShapeDtypeStruct
    Bt, T, Ht, D = 2, 150, 3, 128
    args = (f((Bt, T, Ht, D), jnp.bfloat16), f((Bt, T, Ht, D), jnp.bfloat16),
            f((Bt, T, Ht, D), jnp.bfloat16), f((Bt, T, Ht, D), jnp.float32),
            f((Bt, T, Ht), jnp.float32), f((Bt, Ht, D, D), jnp.float32))
    fn = lambda q, k, v, g, b, s0: tpu_chunk_kda(q, k, v, g, b, initial_state=s0)  # noqa: E731
    with target("tpu"):  # compile for TPU, not the interpreter
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize("varlen", [False, True])
def test_api_runs_it_and_differentiates(varlen: bool) -> None:
    """chunk_kda(implementation="mosaic_tpu") runs this kernel (here in the TPU interpreter), with
    or without cu_seqlens, and is differentiable (the reference's VJP); the policy never picks it
    (tests/pallas_kernels/kda/test_backends.py)."""
    x, cu = packed((30, 35), seed=4) if varlen else (make_inputs(65, seed=4), None)
    cot = jax.random.normal(jax.random.key(0), x["v"].shape)

    def loss(implementation, q, k, v, g, beta, s0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                         cu_seqlens=cu, implementation=implementation, lower_bound=LB)
        return jnp.sum(o * cot) + jnp.sum(s * s0)

    args = (*_args(x), x["s0"])
    got = loss("mosaic_tpu", *args)
    grads = jax.grad(lambda *a: loss("mosaic_tpu", *a), argnums=(0, 5))(*args)
    assert rel(got, loss("xla", *args)) <= 1e-5
    expected = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 5))(*args)
    for got_g, want_g in zip(grads, expected):
        assert rel(got_g, want_g) <= 1e-5
