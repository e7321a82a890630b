"""Mosaic TPU KDA decode step under the TPU interpreter (CPU, race detection on) vs recurrent_kda_step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.mosaic_tpu.decode import tpu_kda_decode
from pallas_kernels.kda.reference import recurrent_kda_step
from pallas_kernels.platform import target

INTERP = pltpu.InterpretParams(detect_races=True)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _inputs(B, H, K, V, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, K))
    k = rng.standard_normal((B, H, K))
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return (
        f(q / np.linalg.norm(q, axis=-1, keepdims=True)),
        f(k / np.linalg.norm(k, axis=-1, keepdims=True)),
        f(rng.standard_normal((B, H, V))),
        f(-5.0 * _sigmoid(2.0 * rng.standard_normal((B, H, K)))),
        f(_sigmoid(rng.standard_normal((B, H)))),
        f(rng.standard_normal((B, H, K, V))),
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _no_races():
    return _tpu_interp.races is not None and not _tpu_interp.races.races_found


@pytest.mark.parametrize("B,H,K,V,bv", [(2, 3, 128, 128, None), (2, 3, 128, 256, None), (1, 2, 128, 256, 128),
                                        (2, 1, 64, 128, None)])
def test_step_matches_reference(B, H, K, V, bv):
    q, k, v, g, beta, s = _inputs(B, H, K, V, seed=K + V + B)
    o, s1 = tpu_kda_decode(q, k, v, g, beta, s, block_v=bv, interpret=INTERP)
    ro, rs = recurrent_kda_step(q, k, v, g, beta, s)
    assert o.shape == (B, H, V) and o.dtype == jnp.float32
    assert s1.shape == (B, H, K, V) and s1.dtype == jnp.float32
    assert _rel(o, ro) <= 1e-6 and _rel(s1, rs) <= 1e-6
    assert _no_races()


def test_ten_chained_steps():
    B, H, K, V = 2, 3, 128, 256
    s = rs = jnp.zeros((B, H, K, V), jnp.float32)
    for t in range(10):
        q, k, v, g, beta, _ = _inputs(B, H, K, V, seed=1000 + t)
        o, s = tpu_kda_decode(q, k, v, g, beta, s, interpret=INTERP)
        ro, rs = recurrent_kda_step(q, k, v, g, beta, rs)
        assert _rel(o, ro) <= 1e-6, t
    assert _rel(s, rs) <= 1e-6
    assert _no_races()


def test_bf16_io_and_scale():
    B, H, K, V = 1, 2, 128, 128
    q, k, v, g, beta, s = _inputs(B, H, K, V, seed=7)
    qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))
    o, s1 = tpu_kda_decode(qb, kb, vb, g, beta, s, scale=0.3, interpret=INTERP)
    ro, rs = recurrent_kda_step(qb, kb, vb, g, beta, s, scale=0.3)
    assert o.dtype == jnp.bfloat16 and s1.dtype == jnp.float32
    assert _rel(s1, rs) <= 1e-6 and _rel(o, ro) <= 1e-2
    assert _no_races()


def test_bad_block_v():
    q, k, v, g, beta, s = _inputs(1, 1, 128, 256, seed=0)
    with pytest.raises(ValueError):
        tpu_kda_decode(q, k, v, g, beta, s, block_v=64, interpret=INTERP)


def test_two_cores_race_free():
    """Both grid axes are 'parallel': split them over two simulated TensorCores with race detection."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    args = _inputs(2, 3, 128, 256, seed=5)
    o, s1 = tpu_kda_decode(*args, block_v=128, interpret=params)
    ro, rs = recurrent_kda_step(*args)
    assert _rel(o, ro) <= 1e-6 and _rel(s1, rs) <= 1e-6
    assert _no_races()


def test_lowers_to_mosaic_tpu():
    """Cross-lowering for TPU on CPU: the Pallas -> Mosaic MLIR step succeeds (no libtpu compile)."""
    B, H, K, V = 2, 3, 128, 256
    f = jax.ShapeDtypeStruct
    args = (f((B, H, K), jnp.bfloat16), f((B, H, K), jnp.bfloat16), f((B, H, V), jnp.bfloat16),
            f((B, H, K), jnp.float32), f((B, H), jnp.float32), f((B, H, K, V), jnp.float32))
    with target("tpu"):  # compile for TPU, not the interpreter
        lowered = jax.jit(lambda *a: tpu_kda_decode(*a)).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
