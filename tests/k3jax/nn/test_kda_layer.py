"""The KimiDeltaAttention layer against an independent float64 numpy implementation.

Data path (k3-architecture.md §6.2, golden README §7): q/k/v projections -> depthwise causal conv
(kernel 4, fp32 weights [P, 1, W], SiLU) -> q, k L2-normalised (eps 1e-6 inside the sqrt) ->
g = lb * sigmoid(exp(A_log[h]) * (f_b(f_a x) + dt_bias)), beta = sigmoid(b_proj x) -> token-by-token
recurrence S <- diag(e^g) S; S += beta k (v - S^T k)^T; o = S^T q * K^-0.5 -> per-head RMSNorm
(eps 1e-5) * gain * sigmoid(g_proj x) -> o_proj.

The layer's default kernels (the policy: the XLA reference on CPU) are checked against that loop; the
GPU kernels' path ("pallas_gpu", the activations fused into the chunk kernel, in interpret mode) against
the default, with left padding, gradients and prefill + decode.
"""

from __future__ import annotations


import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.config import L2_NORM_EPS, K3Config  # noqa: E402
from k3jax.kernels import Kernels  # noqa: E402
from k3jax.nn.kda import KDACache, KimiDeltaAttention  # noqa: E402
from pallas_kernels import kda as kda_ops  # noqa: E402
from tests.conftest import GOLDEN_DIR  # noqa: E402

# fp32 layer vs float64 loop: GEMMs over <= 128-term sums, a 4-tap conv, normalisations, and a
# recurrence whose state is contractive (|e^g| < 1, unit-norm k, beta < 1), evaluated by the
# chunked (64-token chunks, triangular solves) algorithm. The KDA kernel tests bound the chunked
# vs exact recurrence at ~1e-6 relative; the projections add ~1e-7 each. 1e-5 of max|ref| leaves
# a safe margin and is far below the effect of any structural mistake (>= 1e-3).
TOL = 1e-5


@pytest.fixture(scope="module")
def cfg() -> K3Config:
    """The golden tiny config in float32."""
    return K3Config.from_hf(GOLDEN_DIR, dtype="float32")


def make_layer(cfg: K3Config, kernels: Kernels = Kernels()) -> KimiDeltaAttention:
    """The same parameters for every `kernels` (same seed, the same non-trivial output gain)."""
    m = KimiDeltaAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=kernels)
    rng = np.random.default_rng(1)
    m.o_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.kda_head_dim), jnp.float32)  # non-trivial gain
    return m


@pytest.fixture(scope="module")
def kda(cfg: K3Config) -> KimiDeltaAttention:
    return make_layer(cfg)


@pytest.fixture(scope="module")
def kda_gpu(cfg: K3Config) -> KimiDeltaAttention:
    """The GPU kernels' path (Pallas interpret mode on CPU), prefill and decode."""
    return make_layer(cfg, Kernels(kda="pallas_gpu", kda_decode="pallas_gpu"))


def p64(param) -> np.ndarray:
    return np.asarray(param[...], np.float64)


def np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def np_raw_projections(m: KimiDeltaAttention, x: np.ndarray) -> np.ndarray:
    """[B, T, 3P]: q | k | v projections before the conv (the layout the conv cache stores)."""
    return np.concatenate([x @ p64(m.q_proj.weight).T, x @ p64(m.k_proj.weight).T, x @ p64(m.v_proj.weight).T], -1)


def np_kda_layer(m: KimiDeltaAttention, cfg: K3Config, x: np.ndarray, *, decay_first: bool = True):
    """float64 layer forward from zero state and zero conv context. Returns (out, final state [B,H,K,V])."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, kd, p, width = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim, cfg.kda_conv_kernel
    raw = np_raw_projections(m, x)
    conv_w = np.concatenate([p64(m.q_conv1d.weight), p64(m.k_conv1d.weight), p64(m.v_conv1d.weight)])[:, 0, :]
    padded = np.concatenate([np.zeros((b, width - 1, 3 * p)), raw], axis=1)
    conv = np.zeros_like(raw)
    for s in range(t):  # y[s] = sum_j w[:, j] * raw[s - W + 1 + j]
        conv[:, s] = np.sum(padded[:, s : s + width] * conv_w.T[None], axis=1)
    act = conv * np_sigmoid(conv)
    q, k, v = (a.reshape(b, t, h, kd) for a in np.split(act, 3, axis=-1))
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)

    z = (x @ p64(m.f_a_proj.weight).T) @ p64(m.f_b_proj.weight).T + p64(m.dt_bias)
    a = np.exp(p64(m.A_log))[:, None]  # [H, 1]
    g = cfg.kda_gate_lower_bound * np_sigmoid(a * z.reshape(b, t, h, kd))
    beta = np_sigmoid(x @ p64(m.b_proj.weight).T)  # [B, T, H]

    state = np.zeros((b, h, kd, kd))  # [B, H, K, V]
    o = np.zeros((b, t, h, kd))
    for s in range(t):
        if decay_first:
            state = state * np.exp(g[:, s])[..., None]
        pred = np.einsum("bhk,bhkv->bhv", k[:, s], state)
        state = state + beta[:, s, :, None, None] * k[:, s, :, :, None] * (v[:, s] - pred)[:, :, None, :]
        if not decay_first:
            state = state * np.exp(g[:, s])[..., None]
        o[:, s] = np.einsum("bhk,bhkv->bhv", q[:, s] * kd**-0.5, state)  # read after the write

    gate = (x @ p64(m.g_proj.weight).T).reshape(b, t, h, kd)
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + cfg.rms_norm_eps) * p64(m.o_norm.weight) * np_sigmoid(gate)
    return o.reshape(b, t, h * kd) @ p64(m.o_proj.weight).T, state


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def inputs(cfg: K3Config, t: int, seed: int, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, t, cfg.hidden_size)).astype(np.float32)


def forward(m: KimiDeltaAttention, x: jax.Array) -> jax.Array:
    return m(x)[0]


# The layer runs eagerly here (the KDA kernels inside are themselves jitted). Wrapping the whole
# uncached layer in jit on CPU trips an XLA:CPU YNNPACK-fusion miscompile (garbage outputs for some
# sequence lengths); see test_jitted_forward_matches_numpy below.
with_cache = KimiDeltaAttention.__call__


@pytest.mark.parametrize("t", [1, 5, 70])  # 70 crosses the 64-token chunk boundary
def test_forward_matches_numpy(kda: KimiDeltaAttention, cfg: K3Config, t: int) -> None:
    x = inputs(cfg, t, seed=t)
    out = forward(kda, jnp.asarray(x))
    ref, _ = np_kda_layer(kda, cfg, x)
    assert out.shape == x.shape and out.dtype == jnp.float32
    assert rel(out, ref) <= TOL, rel(out, ref)


def test_jitted_forward_matches_numpy(kda: KimiDeltaAttention, cfg: K3Config) -> None:
    """Jitted without a cache: XLA:CPU once miscompiled this (constant zero state) for T = 7, 8, 12."""
    jitted = jax.jit(lambda m, x: m(x)[0])
    for t in (7, 8, 12):
        x = inputs(cfg, t, seed=t)
        ref, _ = np_kda_layer(kda, cfg, x)
        assert rel(jitted(kda, jnp.asarray(x)), ref) <= TOL, t


def test_reference_is_sensitive(kda: KimiDeltaAttention, cfg: K3Config) -> None:
    """Decaying after the delta write (a plausible ordering bug) moves the output far beyond TOL."""
    x = inputs(cfg, 5, seed=4)
    ref, _ = np_kda_layer(kda, cfg, x)
    assert rel(np_kda_layer(kda, cfg, x, decay_first=False)[0], ref) > 100 * TOL
    assert rel(forward(kda, jnp.asarray(x)), ref) <= TOL


# Cached vs uncached: the same fp32 function, evaluated as one chunked pass or as chunked prefill +
# recurrent steps; both within ~1e-6 of exact, so 1e-5 of max|out| is a safe bound.
# Totals of 5 reuse the compiled T=5 chunked kernel; chunk lengths 1, 2, 3 keep compiles few.
@pytest.mark.parametrize("schedule", [(2, 1, 1, 1), (3, 1, 1), (1, 1, 1, 1, 1), (2, 2, 1)],
                         ids=["prompt2", "prompt3", "prompt1", "prompt2-chunk2"])
def test_prefill_then_decode_matches_full_forward(kda: KimiDeltaAttention, cfg: K3Config, schedule) -> None:
    total = sum(schedule)
    x = jnp.asarray(inputs(cfg, total, seed=100 + len(schedule) + schedule[0]))
    full = forward(kda, x)
    cache = KDACache.empty(cfg, x.shape[0], jnp.float32)
    assert cache.state.shape == (2, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    assert cache.conv.shape == (2, cfg.kda_conv_kernel - 1, 3 * cfg.kda_proj_dim)
    outs, pos = [], 0
    for n in schedule:  # first entry: the prompt; then a chunk (n > 1) or single-token decode steps
        out, cache = with_cache(kda, x[:, pos : pos + n], cache)
        outs.append(out)
        pos += n
    assert rel(jnp.concatenate(outs, axis=1), full) <= TOL
    # The cached state is the float64 recurrence's final state.
    _, state_ref = np_kda_layer(kda, cfg, np.asarray(x))
    assert rel(cache.state, state_ref) <= TOL


def test_conv_cache_across_short_prompt(kda: KimiDeltaAttention, cfg: K3Config) -> None:
    """A 2-token prompt is shorter than the 4-tap conv: the cache holds [0, raw_0, raw_1] and the first
    decode step convolves over exactly those plus its own input."""
    x = inputs(cfg, 3, seed=7)
    cache = KDACache.empty(cfg, 2, jnp.float32)
    _, cache = with_cache(kda, jnp.asarray(x[:, :2]), cache)
    raw = np_raw_projections(kda, x.astype(np.float64))
    conv = np.asarray(cache.conv, np.float64)
    np.testing.assert_array_equal(conv[:, 0], 0.0)
    assert rel(conv[:, 1:], raw[:, :2]) <= 1e-6  # plain fp32 projections (<= 128-term sums)
    out, cache = with_cache(kda, jnp.asarray(x[:, 2:3]), cache)
    assert rel(cache.conv, raw[:, :3]) <= 1e-6  # the window slid by one: [raw_0, raw_1, raw_2]
    ref, _ = np_kda_layer(kda, cfg, x)
    assert rel(out, ref[:, 2:3]) <= TOL


def test_l2_norm_eps_is_the_kernels() -> None:
    """The model's q/k L2-norm epsilon is the one the KDA op (and its fused kernels) use."""
    assert L2_NORM_EPS == kda_ops.L2_NORM_EPS


def test_kernels_are_static(kda_gpu: KimiDeltaAttention) -> None:
    """The kernel choice is part of the module's structure (graphdef), not of its state."""
    graphdef, state = nnx.split(kda_gpu)
    assert nnx.merge(graphdef, state).kernels == Kernels(kda="pallas_gpu", kda_decode="pallas_gpu")
    assert all(not isinstance(leaf, Kernels) for leaf in jax.tree_util.tree_leaves(state))


# "pallas_gpu" vs the default: the same fp32 function (the chunk kernel's in-kernel activations vs XLA's),
# the kernel within ~1e-6 of the exact recurrence in the kernel tests; the layer's max-norm bound TOL holds.
def test_fused_path_matches_default(kda: KimiDeltaAttention, kda_gpu: KimiDeltaAttention, cfg: K3Config) -> None:
    x = jnp.asarray(inputs(cfg, 70, seed=11))  # 70 crosses the 64-token chunk boundary
    ref, _ = np_kda_layer(kda, cfg, np.asarray(x))
    assert rel(forward(kda_gpu, x), forward(kda, x)) <= TOL
    assert rel(forward(kda_gpu, x), ref) <= TOL


def _left_padded(cfg: K3Config, lens: tuple[int, ...], t: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Inputs [len(lens), t, D] whose row b holds lens[b] real tokens after t - lens[b] pad steps (random
    junk there, which must not matter), and the valid mask."""
    x = jnp.asarray(inputs(cfg, t, seed=seed, batch=len(lens)))
    valid = jnp.asarray(np.arange(t)[None, :] >= t - np.asarray(lens)[:, None])
    return x, valid


@pytest.mark.parametrize("layer", ["kda", "kda_gpu"])
def test_left_padding_is_exact(layer: str, cfg: K3Config, request) -> None:
    """Pad steps are identities on both paths: each row's real tokens give what they give alone, the
    state is the unpadded run's, and the gradients (parameters and inputs, A_log and dt_bias included)
    are finite and equal the unpadded ones, zero at the pad steps."""
    m = request.getfixturevalue(layer)
    lens, t = (5, 70), 70
    x, valid = _left_padded(cfg, lens, t, seed=21)
    cache = KDACache.empty(cfg, len(lens), jnp.float32)
    out, cache = with_cache(m, x, cache, valid)
    for b, n in enumerate(lens):
        alone, alone_cache = with_cache(m, x[b : b + 1, t - n :], KDACache.empty(cfg, 1, jnp.float32))
        assert rel(out[b : b + 1, t - n :], alone) <= TOL, b
        assert rel(cache.state[b : b + 1], alone_cache.state) <= TOL, b

    def loss(module, x, valid):
        out, _ = module(x, valid=valid)
        return jnp.sum(jnp.where(valid[..., None], out, 0.0) ** 2)

    grads, dx = jax.grad(loss, argnums=(0, 1))(m, x, valid)
    params = nnx.state(grads, nnx.Param)
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree_util.tree_leaves(params)), "NaN/inf gradient"
    assert bool(jnp.isfinite(dx).all()) and not bool(jnp.any(dx[~valid]))
    b, n = 0, lens[0]  # the short row alone: the same parameter gradients as its padded run
    grads_b, _ = jax.grad(loss, argnums=(0, 1))(m, x[b : b + 1], valid[b : b + 1])
    grads_alone, _ = jax.grad(loss, argnums=(0, 1))(m, x[b : b + 1, t - n :], valid[b : b + 1, t - n :])
    for name in ("A_log", "dt_bias"):
        got, want = getattr(grads_b, name)[...], getattr(grads_alone, name)[...]
        assert float(jnp.abs(want).max()) > 0, name
        assert rel(got, want) <= TOL, name


def test_fused_path_gradients_match_default(kda: KimiDeltaAttention, kda_gpu: KimiDeltaAttention,
                                            cfg: K3Config) -> None:
    """The GPU path's custom VJP (analytic backward on the activated inputs, pulled back through the
    activations in XLA) against autodiff of the XLA path: every parameter's gradient (A_log, dt_bias, the
    gate and beta projections included) and the input's, on a left-padded batch."""
    x, valid = _left_padded(cfg, (5, 70), 70, seed=31)

    def loss(module, x):
        out, _ = module(x, valid=valid)
        return jnp.sum(jnp.where(valid[..., None], out, 0.0) ** 2)

    (g_ref, dx_ref), (g_gpu, dx_gpu) = (jax.grad(loss, argnums=(0, 1))(m, x) for m in (kda, kda_gpu))
    assert rel(dx_gpu, dx_ref) <= TOL
    ref_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(g_ref, nnx.Param))
    gpu_leaves = jax.tree_util.tree_leaves(nnx.state(g_gpu, nnx.Param))
    for (path, want), got in zip(ref_leaves, gpu_leaves):
        assert rel(got, want) <= TOL, jax.tree_util.keystr(path)


def test_prefill_then_decode_on_the_gpu_kernels(kda: KimiDeltaAttention, kda_gpu: KimiDeltaAttention,
                                                cfg: K3Config) -> None:
    """Prefill through the fused chunk kernel, then decode steps through the decode kernel: the default
    path's full forward."""
    x = jnp.asarray(inputs(cfg, 6, seed=41))
    full = forward(kda, x)
    cache = KDACache.empty(cfg, x.shape[0], jnp.float32)
    outs = []
    for start, stop in ((0, 4), (4, 5), (5, 6)):
        out, cache = with_cache(kda_gpu, x[:, start:stop], cache)
        outs.append(out)
    assert rel(jnp.concatenate(outs, axis=1), full) <= TOL


def test_decode_runs_the_layers_choice(cfg: K3Config) -> None:
    """The decode step dispatches on `kernels.kda_decode` (prefill on `kernels.kda`)."""
    m = make_layer(cfg, Kernels(kda_decode="no_such_kernel"))
    x = jnp.asarray(inputs(cfg, 3, seed=51))
    _, cache = with_cache(m, x[:, :2], KDACache.empty(cfg, 2, jnp.float32))
    with pytest.raises(ValueError, match="kda_decode: implementation 'no_such_kernel' is unknown"):
        with_cache(m, x[:, 2:3], cache)
