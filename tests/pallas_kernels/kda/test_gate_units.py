"""The GPU kernels' bf16 path keeps log-decays in units of ln 2 and takes the hardware exp2 and
reciprocal (``intra_blocks.gate_exp``). The instructions themselves only run on a GPU; here they
are replaced by exact ``2**x`` and ``1/x``, which checks the algebra that switches units: the
-log2(e) folded into the gate's scale, the clamp scaled with it, and gradients that must stay
those of natural log-decays. Both sides are fp32 with IEEE products; they differ only by the
rounding of ``x log2(e)`` (|G| up to ~300 nats gives ~1e-5 relative in a decay factor), so 1e-4
is tight enough that a wrong unit anywhere (a factor 1.44 in an exponent) fails by orders of
magnitude.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ptx_math
from pallas_kernels.kda import chunk_math
from pallas_kernels.kda.triton import intra_blocks
from pallas_kernels.kda.chunk_math import C, causal_masks, key_grads_from_sums, row_block
from tests.pallas_kernels.kda.kda_cases import rel


@pytest.fixture
def exact_ptx(monkeypatch):
    """``gate_exp(True)`` and the approximate sigmoid with exact stand-ins for the PTX ops."""
    monkeypatch.setattr(ptx_math, "exp2", jnp.exp2)
    monkeypatch.setattr(ptx_math, "reciprocal", lambda x: 1.0 / x)


def chunk(seed: int = 0, K: int = 16):
    """One chunk of the safe gate: log-decays in [-5, 0], four channels at the bound -5 (35 nats
    inside a sub-chunk, where a clamp left in natural units would cut), unit-norm q and k."""
    r = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    q, k = unit(r.standard_normal((C, K))), unit(r.standard_normal((C, K)))
    g = -5.0 * r.random((C, K))
    g[:, :4] = -5.0
    beta = r.random(C)
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, g, beta))


def test_fused_gate_in_log2_units(exact_ptx) -> None:
    K, h = 16, 1
    r = np.random.default_rng(1)
    gate_scale = jnp.asarray(np.exp(r.uniform(-1, 1, (2, K))), jnp.float32)
    dt_bias = jnp.asarray(r.standard_normal((2, K)), jnp.float32)
    g_raw = jnp.asarray(3 * r.standard_normal((C, K)), jnp.float32)
    exact = intra_blocks.activations(True, -5.0, gate_scale, dt_bias, h, approx=False)[0](g_raw)
    log2 = intra_blocks.activations(True, -5.0, gate_scale, dt_bias, h, approx=True)[0](g_raw)
    assert rel(log2, exact * ptx_math.LOG2E) < 1e-6


def test_pre_activated_gate_in_log2_units(exact_ptx) -> None:
    g = chunk()[2]
    log2 = intra_blocks.activations(False, 0.0, None, None, 0, approx=True)[0](g)
    assert rel(log2, g * ptx_math.LOG2E) < 1e-7


def test_pair_scores_in_log2_units(exact_ptx) -> None:
    q, k, g, _ = chunk()
    G = jnp.cumsum(g, axis=0)
    unit, exp2 = intra_blocks.gate_exp(True)
    causal = causal_masks()[0]
    natural = chunk_math.pair_scores_many((k, q), k, G, jnp.float32)
    in_log2 = chunk_math.pair_scores_many((k, q), k, G * unit, jnp.float32, unit, exp2)
    for a, b in zip(in_log2, natural):
        assert rel(jnp.where(causal, a, 0.0), jnp.where(causal, b, 0.0)) < 1e-4


def test_key_grads_in_log2_units(exact_ptx) -> None:
    """Gradients w.r.t. the natural log-decays ``g`` whichever unit the kernel computes in."""
    q, k, g, beta = chunk(2)
    r = np.random.default_rng(3)
    causal, strict = causal_masks()
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    dL, dAqk = jnp.where(strict, f(C, C), 0.0), jnp.where(causal, f(C, C), 0.0)
    sums = (f(C, k.shape[1]), f(C, k.shape[1]), f(C, k.shape[1]), f(1, k.shape[1]))

    def grads(*unit_exp):
        return key_grads_from_sums(q, k, g, beta, lambda i: row_block(dL, i),
                                   lambda i: row_block(dAqk, i), lambda: sums, jnp.float32,
                                   *unit_exp)

    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), grads(*intra_blocks.gate_exp(True)),
                          grads()):
        assert rel(a, b) < 1e-4, name
