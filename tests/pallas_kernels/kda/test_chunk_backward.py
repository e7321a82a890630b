"""The analytic chunked KDA backward (pure JAX) against autodiff of the fp32 references.

Tolerance 1e-5 (relative L2): both sides are fp32 with IEEE matmuls and compute the same
derivative in different operation orders (autodiff of a triangular solve and pairwise-decay
tensors vs. the closed form with midpoint-factored decays), so they differ by accumulated fp32
rounding, measured at <= 2e-6 (dg, a 64-term reverse cumsum) and <= 2e-7 elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.reference import chunked_kda, naive_recurrent_kda
from tests.pallas_kernels.kda.chunk_backward import chunk_kda_bwd
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case
from tests.pallas_kernels.kda.kda_cases import rel as kda_rel

B, H, K, V = 2, 2, 16, 24  # K != V on purpose
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_case(T: int, seed: int) -> dict[str, jax.Array]:
    """K3-like inputs plus random cotangents for o and the state."""
    rng = np.random.default_rng(seed)
    x = kda_case(rng, B, T, H, K, V)
    x["do"] = rng.standard_normal((B, T, H, V))
    x["dht"] = rng.standard_normal((B, H, K, V))
    return as_f32(x)


def rel(a: jax.Array, b: jax.Array) -> float:
    """Relative L2 error; the 1e-2 floor covers gradients that are exactly zero (dg at T=1
    without an initial state: the decay then multiplies a zero state)."""
    return kda_rel(a, b, floor=1e-2)


def reference_grads(fn, x: dict[str, jax.Array], with_state: bool) -> tuple[jax.Array, ...]:
    s0 = x["s0"] if with_state else jnp.zeros_like(x["s0"])
    _, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5]),
                     x["q"], x["k"], x["v"], x["g"], x["beta"], s0)
    return vjp((x["do"], x["dht"]))


def analytic_grads(x: dict[str, jax.Array], with_state: bool) -> tuple[jax.Array, ...]:
    s0 = x["s0"] if with_state else jnp.zeros_like(x["s0"])
    return chunk_kda_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], s0, x["do"], x["dht"],
                         scale=K**-0.5)


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_matches_chunked_reference_autodiff(T: int, with_state: bool) -> None:
    x = make_case(T, seed=T)
    want = reference_grads(lambda *a, **kw: chunked_kda(*a, scale=K**-0.5, **kw), x, with_state)
    got = analytic_grads(x, with_state)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == jnp.float32, name
        assert rel(a, b) <= 1e-5, name


def test_matches_recurrent_autodiff_at_the_bound() -> None:
    """Half the channels decay at the bound every step: the widest in-chunk decay spreads."""
    x = make_case(70, seed=11)
    x["g"] = jnp.where(jnp.arange(K) % 2 == 0, -4.999, x["g"])
    want = reference_grads(lambda *a, **kw: naive_recurrent_kda(*a, **kw), x, True)
    got = analytic_grads(x, True)
    for name, a, b in zip(NAMES, got, want):
        assert np.isfinite(np.asarray(a)).all(), name
        assert rel(a, b) <= 1e-5, name


def test_bf16_inputs_stay_close() -> None:
    """bf16 q/k/v/g/beta/do take bf16 matmuls (the pairwise gradient products TF32; exact fp32 on
    CPU): gradients within bf16 rounding of the fp32 ones of the same (bf16-valued) inputs,
    measured 2e-3 - 3.3e-3 at T=130."""
    x = make_case(130, seed=5)
    low = ("q", "k", "v", "g", "beta", "do")
    x = {n: (a.astype(jnp.bfloat16).astype(jnp.float32) if n in low else a) for n, a in x.items()}
    want = analytic_grads(x, True)
    got = analytic_grads({n: (a.astype(jnp.bfloat16) if n in low else a) for n, a in x.items()},
                         True)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == (jnp.float32 if name == "initial_state" else jnp.bfloat16), name
        assert rel(a, b) <= 1e-2, name
