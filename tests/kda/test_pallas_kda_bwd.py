"""The Pallas KDA backward kernels (interpret mode on CPU) against the pure-JAX analytic backward.

The kernels recompute the chunk quantities with the forward's own intra kernels (16-row blocks,
G_last summed directly) while the pure-JAX backward uses whole-chunk algebra and G_last = the last
row of the cumsum, exactly like the reference. With in-chunk log decays |G| up to ~160, fp32
rounding of those two sums moves exp(G_last - G) by ~|G| * 6e-8 ~ 1e-5 relative, so the two agree
to 2e-5 (measured <= 1e-5; both are within that of autodiff of the reference).
block_v = grads_block_v = 8 < V = 24 exercises the V split of the state recurrences and the V loop
of the gradient kernel.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from test_chunk_backward import NAMES, K, make_case, rel

from pallas_kernels.kda.chunk_backward import chunk_kda_bwd
from pallas_kernels.kda.pallas_kda_bwd import pallas_chunk_kda_bwd


def _args(x, with_state: bool) -> tuple:
    s0 = x["s0"] if with_state else jnp.zeros_like(x["s0"])
    return x["q"], x["k"], x["v"], x["g"], x["beta"], s0, x["do"], x["dht"]


@pytest.mark.parametrize(("T", "with_state"), [(1, True), (65, True), (150, False), (150, True)])
def test_matches_pure_jax_backward(T: int, with_state: bool) -> None:
    args = _args(make_case(T, seed=T), with_state)
    want = chunk_kda_bwd(*args, scale=K**-0.5)
    got = pallas_chunk_kda_bwd(*args, scale=K**-0.5, interpret=True, block_v=8, grads_block_v=8)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel(a, b) <= 2e-5, name


def test_bf16_matches_pure_jax_backward() -> None:
    """bf16 inputs: bf16 intermediates in HBM (kernels) vs fp32 ones (pure JAX), same matmuls."""
    x = make_case(130, seed=3)
    args = tuple(a.astype(jnp.bfloat16) if i in (0, 1, 2, 3, 4, 6) else a
                 for i, a in enumerate(_args(x, True)))
    want = chunk_kda_bwd(*args, scale=K**-0.5)
    got = pallas_chunk_kda_bwd(*args, scale=K**-0.5, interpret=True, block_v=8, grads_block_v=8)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype, name
        assert rel(a, b) <= 3e-2, name


def test_validates_block_v() -> None:
    args = _args(make_case(1, seed=0), True)
    with pytest.raises(ValueError, match="block_v"):
        pallas_chunk_kda_bwd(*args, scale=1.0, interpret=True, block_v=16)
    with pytest.raises(ValueError, match="grads_block_v"):
        pallas_chunk_kda_bwd(*args, scale=1.0, interpret=True, grads_block_v=16)
