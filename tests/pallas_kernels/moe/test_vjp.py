"""Backward of the routed experts' kernels (pallas_kernels/moe/vjp.py) on the "pallas_gpu" backend, in
interpret mode on CPU.

Oracles: `lax.ragged_dot_general` with a ragged contracting dimension for the weight-gradient kernel
`grouped_matmul_tn`; for the whole path jax.grad of `experts_ragged_dot` (XLA autodiff through lax.ragged_dot
and the reference SiTU), fp32.
Tolerance rel <= 1e-5 (Frobenius norm of the difference over the oracle's): everything is fp32 on both
sides and the two compute the same products; only the fp32 summation order of the GEMMs (tiled k-loop and
row tiles vs XLA's dot) and the SiTU derivative (explicit formula vs autodiff of the same expression, a few
ulps) differ, which stays around 1e-7 relative; 1e-5 leaves two orders of margin while a wrong term
(e.g. a missing sigmoid' or tanh' factor, a transposed weight) gives O(1e-1) errors.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import experts_ragged_dot, pallas_gpu, routed_experts
from pallas_kernels.moe import triton as pg
from pallas_kernels.moe.epilogue import situ_and_grads
from pallas_kernels.moe.reference import situ
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.moe.routed import pallas_gpu_experts

F32 = jnp.float32
# x [M, in] (ragged rows) contracted with y [M, out] over the rows of each group -> [E, in, out].
_RAGGED_CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)
CFG = pg.TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
BETA, LINEAR_BETA = 4.0, 25.0


def _ragged_rows_outer(a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Per group e: a_e^T b_e, a [M, P], b [M, Q] -> [E, P, Q] fp32 (rows past sum(group_sizes) ignored):
    the oracle of `grouped_matmul_tn`."""
    return jax.lax.ragged_dot_general(a, b, group_sizes, _RAGGED_CONTRACT_ROWS, preferred_element_type=F32)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def case(rng, n, e, k, din, f, dout, ids=None):
    x = rng.standard_normal((n, din)) * 2.0
    w1 = rng.standard_normal((e, f, din)) / np.sqrt(din) * 2.0  # gates reach the b1 cap
    w3 = rng.standard_normal((e, f, din)) / np.sqrt(din) * 20.0  # ups reach the b2 cap (tanh' far from 1)
    w2 = rng.standard_normal((e, dout, f)) / np.sqrt(f)
    if ids is None:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    weights = rng.uniform(0.05, 1.0, ids.shape)
    f32 = lambda a: jnp.asarray(a, F32)  # noqa: E731
    return f32(x), f32(w1), f32(w2), f32(w3), f32(weights), jnp.asarray(ids, jnp.int32)


def cases():
    rng = np.random.default_rng(11)
    n = 23
    # experts 0, 3 and 7 never chosen (empty first / middle / last groups); 23*2 = 46 rows over 5 experts
    sparse_ids = np.stack([rng.choice([1, 2, 4, 5, 6], 2, replace=False) for _ in range(n)])
    return {
        # group sizes ~ 46*3/8 rows, not multiples of the 16-row tile; widths 32 / 48 / 32
        "random": case(rng, n, 8, 3, 32, 48, 32),
        "empty_experts": case(rng, n, 8, 2, 32, 48, 32, ids=sparse_ids),
        # k = 1 and every token on expert 3: one group holds all 23 rows, the other seven are empty
        "all_one_expert": case(rng, n, 8, 1, 32, 48, 32, ids=np.full((n, 1), 3)),
        # widths 24 / 40 / 20 are not multiples of 16: gradients flow through pallas_gpu's zero padding
        "odd_widths": case(rng, 19, 6, 2, 24, 40, 20),
    }


def loss_grads(fn, args, cotangent):
    """Gradients w.r.t. x, w1, w2, w3 and the routing weights of <fn(...), cotangent>."""
    loss = lambda *a: jnp.sum(fn(*a, args[5]) * cotangent)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args[:5])


@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, None])
@pytest.mark.parametrize("name", ["random", "empty_experts", "all_one_expert", "odd_widths"])
def test_grads_match_ragged_dot_autodiff(name: str, linear_beta) -> None:
    args = cases()[name]
    x, w1, w2 = args[0], args[1], args[2]
    cot = jax.random.normal(jax.random.key(1), (x.shape[0], w2.shape[1]), F32)
    pallas = functools.partial(pallas_gpu_experts, beta=BETA, linear_beta=linear_beta,
                               gate_up_cfg=CFG, down_cfg=CFG, bwd_cfg=CFG)
    xla = functools.partial(experts_ragged_dot, beta=BETA, linear_beta=linear_beta)
    got, want = loss_grads(pallas, args, cot), loss_grads(xla, args, cot)
    for label, g, w, p in zip(["x", "w1", "w2", "w3", "weights"], got, want, args):
        assert g.shape == p.shape and g.dtype == p.dtype, label
        assert rel(g, w) <= 1e-5, (label, rel(g, w))
    if name in ("empty_experts", "all_one_expert"):  # experts no row reaches get exactly zero gradient
        unused = np.setdiff1d(np.arange(w1.shape[0]), np.asarray(args[5]))
        for g in got[1:4]:
            np.testing.assert_array_equal(np.asarray(g)[unused], 0.0)


def test_routed_experts_pallas_grads_default_tiles() -> None:
    """Through the public entry point with the default (128/64-row) tiles: fewer rows than one tile."""
    args = cases()["random"]
    cot = jax.random.normal(jax.random.key(2), (args[0].shape[0], args[2].shape[1]), F32)
    pallas = functools.partial(routed_experts, beta=BETA, linear_beta=LINEAR_BETA, implementation="pallas_gpu")
    xla = functools.partial(routed_experts, beta=BETA, linear_beta=LINEAR_BETA, implementation="xla")
    for g, w in zip(loss_grads(pallas, args, cot), loss_grads(xla, args, cot)):
        assert rel(g, w) <= 1e-5


@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, None])
def test_situ_derivative_matches_autodiff(linear_beta) -> None:
    # gates and ups across the linear region, the caps and strongly negative gates (sigmoid underflow side)
    g = jnp.concatenate([jnp.linspace(-40.0, 40.0, 4001), jnp.array([0.0, -1e-3, 1e-3, 88.0, -88.0])])
    u = jnp.concatenate([jnp.linspace(-120.0, 120.0, 4001), jnp.array([0.0, 1e-3, -1e-3, 60.0, -60.0])])
    g, u = (a.astype(F32) for a in jnp.meshgrid(g, u[::97]))
    h, dg, du = situ_and_grads(g, u, BETA, linear_beta)
    ref = lambda a, b: situ(a, b, BETA, linear_beta)  # noqa: E731
    ref_dg, ref_du = jax.vmap(jax.vmap(jax.grad(ref, argnums=(0, 1))))(g, u)
    np.testing.assert_allclose(h, ref(g, u), rtol=2e-6, atol=1e-30)
    # elementwise: relative to the local scale of the derivative (a few fp32 ulps of its terms)
    np.testing.assert_allclose(dg, ref_dg, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref_dg))))
    np.testing.assert_allclose(du, ref_du, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref_du))))


TN_GROUPS = {
    "uneven": [10, 0, 33, 20, 7],  # not multiples of the 16-row tile, an empty middle group
    "all_one_group": [0, 0, 75, 0, 0],
    "last_only": [0, 0, 0, 0, 75],
    "tail_rows_ignored": [0, 1, 2, 3, 0],  # sum 6 < M: rows 6.. must not contribute
    "fewer_rows_than_tile": [4, 0, 5, 0, 0],  # with M = 9 < block_k
}


@pytest.mark.parametrize("name", list(TN_GROUPS))
def test_grouped_matmul_tn_matches_ragged_contracting_dot(name: str) -> None:
    m = 9 if name == "fewer_rows_than_tile" else 75
    a = jax.random.normal(jax.random.key(0), (m, 32), F32)
    b = jax.random.normal(jax.random.key(1), (m, 64), F32)
    gs = jnp.asarray(TN_GROUPS[name], jnp.int32)
    cfg = pg.TileConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
    out = pg.grouped_matmul_tn(a, b, gs, cfg=cfg, out_dtype=F32, interpret=True)
    ref = _ragged_rows_outer(a, b, gs)
    assert out.shape == (5, 32, 64) and out.dtype == F32
    assert rel(out, ref) < 1e-6  # same fp32 products, other summation order
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(gs) == 0], 0.0)


def test_grouped_matmul_tn_lowers_to_triton_for_cuda() -> None:
    """dW1/dW3 at K3 shapes (2F = 6144, in = 3584, 28 experts) as the H200 would compile it (no GPU needed)."""
    sds = jax.ShapeDtypeStruct
    args = (sds((16384, 6144), jnp.bfloat16), sds((16384, 3584), jnp.bfloat16), sds((28,), jnp.int32))
    fn = functools.partial(pg.grouped_matmul_tn, out_dtype=F32)
    text = lowered_for_h200(fn, *args)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("experts, on_mosaic", [(28, True), (112, False)])
def test_expert_mlp_backward_lowers_for_cuda(experts: int, on_mosaic: bool) -> None:
    """The whole expert-MLP gradient at K3 widths, 16384 rows, default tiles, as the H200 would compile it,
    with no transposed or concatenated copy of a weight in the program. 28 experts (large groups): the
    products with the forward's weights (gate and up recomputed, dh, dx) in the Mosaic GPU kernel, the
    weight gradients in Triton; 112: the small-group tiles (weights as the MMA's left operand with
    [E, K, N] tiles), every GEMM a Triton kernel."""
    sds = jax.ShapeDtypeStruct
    m, d, f = 16384, 3584, 3072
    args = (sds((m, d), jnp.bfloat16), sds((experts, f, d), jnp.bfloat16), sds((experts, d, f), jnp.bfloat16),
            sds((experts, f, d), jnp.bfloat16))

    def loss(rows, w1, w2, w3, gs):
        out = pallas_gpu.grouped_mlp(rows, gs, w1, w2, w3, beta=BETA, linear_beta=LINEAR_BETA)
        return jnp.sum(out.astype(F32))

    text = lowered_for_h200(jax.grad(loss, argnums=(0, 1, 2, 3)), *args, sds((experts,), jnp.int32))
    # the loss needs no forward output, so only the backward's kernels remain; calls with equal shapes and
    # tiles share one lowered function: gate = up recompute, dh, dx (x2) [Mosaic GPU at 28 experts], dW2,
    # dW1 = dW3
    assert text.count("__gpu$xla.gpu.triton") == (2 if on_mosaic else 5)
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == (3 if on_mosaic else 0)
    assert f"{experts}x{2 * f}x{d}xbf16" not in text  # no [W1; W3] concatenation
    assert "stablehlo.transpose" not in text  # no transposed weights
