"""SiTU-GLU against an independent float64 numpy formula (k3-architecture.md §3).

SiTU(g, u) = b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2): the sigmoid takes the *raw* gate.
"""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.nn.situ import SiTUMLP  # noqa: E402
from pallas_kernels.moe.reference import situ  # noqa: E402

B1, B2 = 4.0, 25.0  # K3's activation_situ_beta / activation_situ_linear_beta


def np_sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic in float64


def np_situ(g: np.ndarray, u: np.ndarray, b1: float, b2: float | None) -> np.ndarray:
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    up = u if b2 is None else b2 * np.tanh(u / b2)
    return b1 * np.tanh(g / b1) * np_sigmoid(g) * up


def np_situ_wrong(g: np.ndarray, u: np.ndarray, b1: float, b2: float) -> np.ndarray:
    """The easy-to-make bug: SiLU of the *capped* gate, silu(softcap(g))."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    capped = b1 * np.tanh(g / b1)
    return capped * np_sigmoid(capped) * b2 * np.tanh(u / b2)


def grid(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gates and ups spanning the linear, bending and saturated regimes of both caps."""
    rng = np.random.default_rng(seed)
    g = np.concatenate([np.linspace(-30, 30, 241), 6.0 * rng.standard_normal(759)])
    u = np.concatenate([np.linspace(-120, 120, 241), 40.0 * rng.standard_normal(759)])
    rng.shuffle(u)
    return g.astype(np.float32), u.astype(np.float32)


# Tolerance for fp32 vs float64: each of tanh, sigmoid and the three products is accurate to a few
# fp32 ulps (eps = 1.2e-7), so the product is within ~1e-6 relative; rtol 1e-5 leaves 10x margin.
# atol 1e-6 covers outputs near zero where relative error is meaningless.
RTOL, ATOL = 1e-5, 1e-6


def test_situ_matches_numpy_formula() -> None:
    g, u = grid()
    out = np.asarray(jax.jit(situ, static_argnums=(2, 3))(jnp.asarray(g), jnp.asarray(u), B1, B2))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np_situ(g, u, B1, B2), rtol=RTOL, atol=ATOL)


def test_situ_uses_raw_gate_sigmoid_not_silu_of_capped_gate() -> None:
    """The wrong variant differs by far more than the tolerance, so the test above would catch it."""
    g, u = grid()
    ref, wrong = np_situ(g, u, B1, B2), np_situ_wrong(g, u, B1, B2)
    gap = np.abs(ref - wrong)
    assert gap.max() > 1.0  # e.g. g = 30, u = 120: 4*1*~25 vs 4*sigmoid(4)*~25, a gap of ~1.8
    out = np.asarray(situ(jnp.asarray(g), jnp.asarray(u), B1, B2), np.float64)
    # Where the variants disagree noticeably, the implementation must sit on the raw-gate one.
    far = gap > 1e-3
    assert far.sum() > 100
    assert np.all(np.abs(out[far] - ref[far]) < 0.1 * gap[far])


def test_situ_bounds() -> None:
    g, u = grid(1)
    out = np.asarray(situ(jnp.asarray(g), jnp.asarray(u), B1, B2))
    # Moderate inputs: strictly inside (-b1*b2, b1*b2) = (-100, 100).
    assert np.all(np.abs(out) < B1 * B2)
    # Extreme inputs: mathematically still < 100, but in fp32 tanh(1e4/4) and sigmoid(1e4) round to
    # exactly 1, so the fp32 output saturates *at* 100; the bound to check in fp32 is <=.
    huge = np.array([-1e4, -1e3, -50.0, 50.0, 1e3, 1e4], np.float32)
    gg, uu = (a.ravel() for a in np.meshgrid(huge, huge))
    out_huge = np.asarray(situ(jnp.asarray(gg), jnp.asarray(uu), B1, B2))
    assert np.all(np.isfinite(out_huge)) and np.all(np.abs(out_huge) <= B1 * B2)
    assert np.abs(out_huge).max() == pytest.approx(B1 * B2, rel=1e-6)
    # The gate factor has a SiLU-like dip with minimum ~ -0.2698 (at g ~ -1.28); with the up branch
    # saturated at +25 the output minimum over g is 25 * that. Checked on a fine grid vs float64.
    gd = np.linspace(-4, 0, 4001).astype(np.float32)
    ud = np.full_like(gd, 1e4)
    dip = np.asarray(situ(jnp.asarray(gd), jnp.asarray(ud), B1, B2)).min()
    assert dip == pytest.approx(np_situ(gd, ud, B1, B2).min(), rel=1e-5)
    assert -0.270 * B2 < dip < -0.269 * B2


def test_situ_without_linear_beta_leaves_up_uncapped() -> None:
    g, u = grid(2)
    u = u * 10  # |u| up to ~1e3, far beyond the cap
    out = np.asarray(situ(jnp.asarray(g), jnp.asarray(u), B1, None))
    ref = np_situ(g, u, B1, None)
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    assert np.abs(out).max() > 10 * B1 * B2  # genuinely uncapped
    # ... and capping would have made a large difference on these inputs.
    assert np.abs(ref - np_situ(g, u, B1, B2)).max() > 100


def test_situ_keeps_gate_dtype() -> None:
    g, u = (jnp.asarray(a, jnp.bfloat16) for a in grid(3))
    out = situ(g, u, B1, B2)
    assert out.dtype == jnp.bfloat16
    # bf16 storage of the result: relative error <= 2^-8 (half a bf16 ulp) plus input rounding.
    ref = np_situ(np.asarray(g, np.float64), np.asarray(u, np.float64), B1, B2)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_mlp_matches_numpy(linear_beta: float | None) -> None:
    hidden, inter, n = 32, 48, 40
    mlp = SiTUMLP(hidden, inter, B1, linear_beta, dtype=jnp.float32, mlp_axis="mlp", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    # Scale inputs so gates reach |g| ~ 10 (well into the b1 = 4 cap) and ups reach |u| > 25.
    x = (8.0 * rng.standard_normal((2, n // 2, hidden))).astype(np.float32)
    out = np.asarray(mlp(jnp.asarray(x)))

    wg = np.asarray(mlp.gate_proj.weight[...], np.float64)
    wu = np.asarray(mlp.up_proj.weight[...], np.float64)
    wd = np.asarray(mlp.down_proj.weight[...], np.float64)
    assert wg.shape == (inter, hidden) and wd.shape == (hidden, inter)  # release layout [out, in]
    x64 = x.astype(np.float64)
    gate, up = x64 @ wg.T, x64 @ wu.T
    assert np.abs(gate).max() > 3 * B1 and np.abs(up).max() > B2  # the caps are exercised
    ref = np_situ(gate, up, B1, linear_beta) @ wd.T
    # fp32 GEMMs with HIGHEST precision over 32/48-term sums plus the activation: relative error
    # ~1e-6 of the output scale; 1e-5 of max|ref| leaves a 10x margin.
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, err
