"""The Triton KDA decode-step kernel (interpret mode on CPU) against ``recurrent_kda_step``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kda_decode, recurrent_kda_step
from pallas_kernels.kda.triton.decode import triton_kda_decode

LB = -5.0


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def make_inputs(B: int, H: int, K: int, V: int, seed: int = 0) -> dict[str, np.ndarray]:
    """K3-like inputs: unit q/k, gate in (-5, 0), beta in (0, 1), O(1) state."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, K))
    k = rng.standard_normal((B, H, K))
    return dict(
        q=q / np.linalg.norm(q, axis=-1, keepdims=True),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=rng.standard_normal((B, H, V)),
        g=LB * _sigmoid(2.0 * rng.standard_normal((B, H, K))),
        beta=_sigmoid(rng.standard_normal((B, H))),
        s=rng.standard_normal((B, H, K, V)),
    )


def _jx(x: dict[str, np.ndarray], dtype=jnp.float32) -> tuple[jax.Array, ...]:
    return (
        *(jnp.asarray(x[n], dtype) for n in ("q", "k", "v")),
        jnp.asarray(x["g"], jnp.float32),
        jnp.asarray(x["beta"], jnp.float32),
        jnp.asarray(x["s"], jnp.float32),
    )


def rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "B,H,K,V,block_v",
    [(1, 1, 16, 32, None), (2, 3, 32, 64, None), (3, 2, 64, 32, 16), (2, 2, 32, 48, None),
     (1, 4, 128, 64, 64)],
)
def test_matches_reference_fp32(B: int, H: int, K: int, V: int, block_v: int | None) -> None:
    x = make_inputs(B, H, K, V, seed=B * 100 + K + V)
    args = _jx(x)
    o, s = triton_kda_decode(*args, block_v=block_v)
    ro, rs = recurrent_kda_step(*args)
    assert o.shape == (B, H, V) and o.dtype == jnp.float32
    assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
    assert rel(o, ro) <= 1e-6 and rel(s, rs) <= 1e-6


def test_custom_scale() -> None:
    args = _jx(make_inputs(2, 2, 32, 64, seed=7))
    o, s = triton_kda_decode(*args, scale=0.3)
    ro, rs = recurrent_kda_step(*args, scale=0.3)
    assert rel(o, ro) <= 1e-6 and rel(s, rs) <= 1e-6


def test_bf16_inputs() -> None:
    args = _jx(make_inputs(2, 3, 32, 64, seed=3), jnp.bfloat16)
    o, s = triton_kda_decode(*args)
    ro, rs = recurrent_kda_step(*args)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel(s, rs) <= 1e-6
    assert rel(o.astype(jnp.float32), ro.astype(jnp.float32)) <= 1e-2  # bf16 rounding of o


@pytest.mark.parametrize("donate", [False, True])
def test_repeated_steps_with_aliased_state(donate: bool) -> None:
    """20 steps feeding each new (aliased, possibly donated) state back in stay on the reference."""
    B, H, K, V = 2, 2, 32, 64
    rng = np.random.default_rng(11)
    s = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
    rs = s
    s0_copy = np.asarray(s).copy()
    s_in = jnp.array(s) if donate else s
    for t in range(20):
        x = make_inputs(B, H, K, V, seed=1000 + t)
        q, k, v, g, beta, _ = _jx(x)
        o, s_in = triton_kda_decode(
            q, k, v, g, beta, s_in, donate_state=donate, block_v=16
        )
        ro, rs = recurrent_kda_step(q, k, v, g, beta, rs)
        assert rel(o, ro) <= 1e-6, t
        assert rel(s_in, rs) <= 1e-6, t
    if not donate:  # the caller's original state buffer is untouched without donation
        np.testing.assert_array_equal(np.asarray(s), s0_copy)


def test_api_dispatch() -> None:
    args = _jx(make_inputs(2, 2, 32, 64, seed=5))
    ro, rs = recurrent_kda_step(*args)
    for impl in (None, "xla", "pallas_gpu"):
        o, s = kda_decode(*args, implementation=impl)
        assert rel(o, ro) <= 1e-6 and rel(s, rs) <= 1e-6, impl
    with pytest.raises(ValueError, match="implementation"):
        kda_decode(*args, implementation="triton")
    with pytest.raises(ValueError, match="state"):
        kda_decode(*args[:5], args[5].astype(jnp.bfloat16), implementation="pallas_gpu")
