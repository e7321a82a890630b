"""Stable LatentMoE and its router against independent float64 numpy references (k3-architecture.md §4).

Router: s = sigmoid(x W_g^T) in fp32; experts = top-k of s + bias; weights = s[chosen] / (sum + 1e-20)
* routed_scaling_factor. Routed path: z = W_down x; y = sum_j w_j E_j(z) in fp32 with
E(z) = w2 SiTU(w1 z, w3 z); RMSNorm (eps 1e-5) with gain; W_up. Plus shared SiTU experts on x.
"""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.config import K3Config  # noqa: E402
from k3jax.kernels import Kernels  # noqa: E402
from k3jax.nn.moe import LatentMoE, route_topk  # noqa: E402
from pallas_kernels.moe import experts_all_dense, experts_ragged_dot, routed_experts  # noqa: E402

from tests.conftest import GOLDEN_DIR as GOLDEN  # noqa: E402
B1, B2 = 4.0, 25.0


def np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))


def np_situ(g, u, b1=B1, b2=B2):
    up = u if b2 is None else b2 * np.tanh(u / b2)
    return b1 * np.tanh(g / b1) * np_sigmoid(g) * up


def np_route(x, gate_w, bias, top_k, renormalize, scaling):
    """float64 router; also returns the gap between the k-th and (k+1)-th biased score."""
    s = np_sigmoid(np.asarray(x, np.float64) @ np.asarray(gate_w, np.float64).T)
    biased = s + np.asarray(bias, np.float64)
    order = np.argsort(-biased, axis=-1, kind="stable")
    ids = order[:, :top_k]
    w = np.take_along_axis(s, ids, -1)
    if renormalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    sorted_b = np.take_along_axis(biased, order, -1)
    gap = (sorted_b[:, top_k - 1] - sorted_b[:, top_k]).min() if top_k < s.shape[1] else np.inf
    return w * scaling, ids, gap


def np_experts(x, w1, w2, w3, weights, ids, b2=B2):
    """sum_j weights[n, j] * w2_e SiTU(w1_e x, w3_e x), float64, per token."""
    x, w1, w2, w3 = (np.asarray(a, np.float64) for a in (x, w1, w2, w3))
    out = np.zeros((x.shape[0], w2.shape[1]))
    for n in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids)[n]):
            out[n] += float(weights[n, j]) * (w2[e] @ np_situ(w1[e] @ x[n], w3[e] @ x[n], B1, b2))
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---- router ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (True, 2.5), (False, 1.0)])
def test_route_topk_matches_numpy(renormalize: bool, scaling: float) -> None:
    n, d, e, k = 24, 32, 16, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d)).astype(np.float32)
    gate = (0.3 * rng.standard_normal((e, d))).astype(np.float32)
    # A strong bias on a few experts: selection then differs from the unbiased top-k, so using the
    # biased scores for the weights (instead of the unbiased ones) would be caught.
    bias = np.zeros(e, np.float32)
    bias[[3, 7, 11]] = [0.6, 0.4, 0.3]
    w, ids = route_topk(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(bias), k, renormalize, scaling)
    w_ref, ids_ref, gap = np_route(x, gate, bias, k, renormalize, scaling)
    # Precondition: no near-ties at the selection boundary, so fp32 and float64 must pick the same set.
    assert gap > 1e-4
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and ids.shape == (n, k)
    np.testing.assert_array_equal(np.asarray(ids), ids_ref)  # same experts, same (descending) order
    # Weights are ratios of fp32 sigmoids (each within ~1 ulp), so |error| <= ~4e-7 * scaling.
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=2e-6, atol=1e-7)
    unbiased_ids = np.argsort(-np_sigmoid(x.astype(np.float64) @ gate.T.astype(np.float64)), -1)[:, :k]
    assert np.any(np.sort(unbiased_ids, -1) != np.sort(ids_ref, -1))  # the bias really changes selection
    if renormalize:
        np.testing.assert_allclose(np.asarray(w).sum(-1), scaling, rtol=1e-6)


def test_route_topk_weights_use_unbiased_scores_with_huge_bias() -> None:
    """A bias that dwarfs the scores decides the selection but never enters the weights."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    gate = rng.standard_normal((8, 16)).astype(np.float32)
    bias = np.array([0, 0, 10, 0, 20, 0, 30, 0], np.float32)  # forces experts 6, 4, 2 in that order
    w, ids = route_topk(jnp.asarray(x), jnp.asarray(gate), jnp.asarray(bias), 3, False, 1.0)
    np.testing.assert_array_equal(np.asarray(ids), np.tile([6, 4, 2], (5, 1)))
    s = np_sigmoid(x.astype(np.float64) @ gate.T.astype(np.float64))
    np.testing.assert_allclose(np.asarray(w), s[:, [6, 4, 2]], rtol=2e-6, atol=1e-7)


# ---- routed experts: dense oracle vs ragged_dot ------------------------------------------------------

def make_expert_case(rng, n, e, k, din, f, dout, ids=None):
    x = rng.standard_normal((n, din)).astype(np.float32) * 2.0  # gates reach the b1 = 4 cap
    w1 = (rng.standard_normal((e, f, din)) / np.sqrt(din) * 1.5).astype(np.float32)
    w3 = (rng.standard_normal((e, f, din)) / np.sqrt(din)).astype(np.float32)
    w2 = (rng.standard_normal((e, dout, f)) / np.sqrt(f)).astype(np.float32)
    if ids is None:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    weights = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    return x, w1, w2, w3, weights, np.asarray(ids, np.int32)


def expert_cases():
    rng = np.random.default_rng(123)
    cases = {
        "random": make_expert_case(rng, 37, 8, 3, 24, 40, 24),
        "rect_out": make_expert_case(rng, 19, 6, 2, 16, 24, 20),  # out width != in width
        # Experts 0 and 5..9 never chosen (group size 0, including the first and the last expert).
        "empty_experts": make_expert_case(
            rng, 12, 10, 2, 16, 24, 16, ids=np.stack([rng.choice([1, 2, 3, 4], 2, replace=False) for _ in range(12)])
        ),
        # Every token routed to the same experts (one group holds all tokens, the rest are empty).
        "all_same": make_expert_case(rng, 9, 8, 3, 16, 24, 16, ids=np.tile([5, 1, 6], (9, 1))),
        "single_token": make_expert_case(rng, 1, 8, 4, 16, 24, 16),
        "top1": make_expert_case(rng, 11, 4, 1, 16, 24, 16),
    }
    return cases


EXPERT_CASES = expert_cases()
_dense = jax.jit(experts_all_dense, static_argnames=("beta", "linear_beta"))
_ragged = jax.jit(experts_ragged_dot, static_argnames=("beta", "linear_beta"))


@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_experts_dense_oracle_matches_ragged_dot_and_numpy(name: str) -> None:
    x, w1, w2, w3, weights, ids = EXPERT_CASES[name]
    args = [jnp.asarray(a) for a in (x, w1, w2, w3, weights, ids)]
    dense = np.asarray(_dense(*args, beta=B1, linear_beta=B2))
    ragged = np.asarray(_ragged(*args, beta=B1, linear_beta=B2))
    ref = np_experts(x, w1, w2, w3, weights, ids)
    assert dense.shape == ragged.shape == ref.shape and dense.dtype == ragged.dtype == np.float32
    # Same fp32 math in two orders (dense einsum over every expert vs sorted grouped GEMMs and a
    # scatter-add of <= k terms per token): they differ by a few ulps of the output scale.
    assert rel(ragged, dense) <= 1e-6, rel(ragged, dense)
    # Against float64: fp32 GEMMs over <= 40-term sums plus SiTU, ~1e-6 relative; 1e-5 = 10x margin.
    assert rel(dense, ref) <= 1e-5
    assert rel(ragged, ref) <= 1e-5


def test_routed_experts_dispatch() -> None:
    x, w1, w2, w3, weights, ids = (jnp.asarray(a) for a in EXPERT_CASES["random"])
    auto = routed_experts(x, w1, w2, w3, weights, ids, beta=B1, linear_beta=B2, implementation=None)
    xla = routed_experts(x, w1, w2, w3, weights, ids, beta=B1, linear_beta=B2, implementation="xla")
    dense = routed_experts(x, w1, w2, w3, weights, ids, beta=B1, linear_beta=B2, implementation="dense")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
    assert rel(auto, dense) <= 1e-6
    with pytest.raises(ValueError):
        routed_experts(x, w1, w2, w3, weights, ids, beta=B1, linear_beta=B2, implementation="bogus")


def test_routed_experts_pallas_is_unavailable_or_correct() -> None:
    """implementation="pallas_gpu" either raises NotImplementedError (no kernel yet) or, once a kernel
    exists (interpret mode on CPU), matches the float64 reference. Smallest case only: interpret
    mode is slow."""
    case = EXPERT_CASES["single_token"]
    args = [jnp.asarray(a) for a in case]
    try:
        out = routed_experts(*args, beta=B1, linear_beta=B2, implementation="pallas_gpu")
    except NotImplementedError:
        return
    # Same fp32 GEMMs as the XLA paths (<= 24-term sums): ~1e-6 relative; 1e-5 = 10x margin.
    assert rel(out, np_experts(*case)) <= 1e-5


# ---- the whole LatentMoE block ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cfg() -> K3Config:
    return K3Config.from_hf(GOLDEN, dtype="float32")


@pytest.fixture(scope="module")
def moe(cfg: K3Config) -> LatentMoE:
    m = LatentMoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    m.routed_expert_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.routed_expert_hidden_size), jnp.float32)
    return m


def p64(param) -> np.ndarray:
    return np.asarray(param[...], np.float64)


def np_latent_moe(m: LatentMoE, cfg: K3Config, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    w, ids, gap = np_route(flat, p64(m.gate.weight), p64(m.gate.e_score_correction_bias),
                           cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
    z = flat @ p64(m.routed_expert_down_proj.weight).T  # latent width
    y = np_experts(z, p64(m.experts.w1), p64(m.experts.w2), p64(m.experts.w3), w, ids, cfg.situ_linear_beta)
    y = y / np.sqrt(np.mean(y * y, -1, keepdims=True) + cfg.rms_norm_eps) * p64(m.routed_expert_norm.weight)
    out = y @ p64(m.routed_expert_up_proj.weight).T
    se = m.shared_experts
    shared = np_situ(flat @ p64(se.gate_proj.weight).T, flat @ p64(se.up_proj.weight).T, B1, cfg.situ_linear_beta)
    out = out + shared @ p64(se.down_proj.weight).T  # shared experts read the full-width input
    return out.reshape(x.shape), ids.reshape(*x.shape[:-1], -1), gap


def test_latent_moe_matches_numpy(moe: LatentMoE, cfg: K3Config) -> None:
    x = np.random.default_rng(3).standard_normal((2, 6, cfg.hidden_size)).astype(np.float32)
    out, ids = moe(jnp.asarray(x))
    ref, ids_ref, gap = np_latent_moe(moe, cfg, x)
    assert gap > 1e-5  # no routing near-tie, so fp32 must select exactly the float64 experts
    np.testing.assert_array_equal(np.asarray(ids), ids_ref)
    assert out.shape == x.shape and out.dtype == jnp.float32
    # fp32 chain of router, 5 GEMMs (<= 128-term sums), SiTU, fp32 weighted sum and an RMSNorm that
    # rescales by O(1): ~1e-6 relative to max|out|; 1e-5 gives a 10x margin.
    assert rel(out, ref) <= 1e-5, rel(out, ref)


def test_latent_moe_dense_and_auto_agree(moe: LatentMoE, cfg: K3Config) -> None:
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 5, cfg.hidden_size)), jnp.float32)
    assert moe.kernels == Kernels()
    out_auto, ids_auto = moe(x)
    moe.kernels = Kernels(moe="dense")
    try:
        out_dense, ids_dense = moe(x)
    finally:
        moe.kernels = Kernels()
    np.testing.assert_array_equal(np.asarray(ids_auto), np.asarray(ids_dense))
    # Same routed sum in two fp32 orders (see the expert test), then identical norm/up/shared paths.
    assert rel(out_auto, out_dense) <= 1e-6


def test_latent_moe_runs_the_kernels_it_was_given(moe: LatentMoE, cfg: K3Config) -> None:
    """`kernels.moe` reaches the routed experts on one device and expert-parallel (an unknown name is
    refused by the routed experts' dispatch, naming it); `Kernels(moe="xla")` is the CPU policy's."""
    from sharding import make_mesh

    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 4, cfg.hidden_size)), jnp.float32)
    out_policy, _ = moe(x)
    try:
        moe.kernels = Kernels(moe="xla")
        np.testing.assert_array_equal(np.asarray(moe(x)[0]), np.asarray(out_policy))
        moe.kernels = Kernels(moe="no_such_kernel")
        with pytest.raises(ValueError, match="implementation 'no_such_kernel' is unknown"):
            moe(x)
        moe.expert_mesh = make_mesh(f"expert={jax.device_count()}")
        with pytest.raises(ValueError, match="implementation 'no_such_kernel' is unknown"):
            moe(x)
    finally:
        moe.kernels, moe.expert_mesh = Kernels(), None
