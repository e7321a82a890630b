"""Gated NoPE MLA against an independent float64 numpy implementation (k3-architecture.md §6.1).

q = q_b(RMSNorm_1e-6(q_a x)); [c | k_pe] = kv_a_proj_with_mqa x; [k_nope | v]_h = kv_b(RMSNorm_1e-6(c));
k_h = [k_nope_h | k_pe] (k_pe shared by all heads, not normalised, never rotated); scale (nope+rope)^-0.5;
causal softmax; o * sigmoid(g_proj x); o_proj.
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
import k3jax.nn.mla as mla_module  # noqa: E402
from k3jax.nn.mla import GatedMLA, MLACache  # noqa: E402

# fp32 vs float64: a chain of five GEMMs over <= 128-term sums (HIGHEST precision on every
# contraction), two RMSNorms, a softmax over <= 9 keys and a sigmoid. Each stage contributes
# ~1e-7..1e-6 relative error; 1e-5 of max|ref| is a ~10x margin and far below the effect of any
# structural mistake (eps, scale, a missing gate or norm all change the output by >= 1e-3).
TOL = 1e-5


@pytest.fixture(scope="module")
def mla(cfg: K3Config) -> GatedMLA:
    m = GatedMLA(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    # Non-trivial norm gains so a gain applied in the wrong place (or to k_pe) is visible.
    m.q_a_layernorm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.q_lora_rank), jnp.float32)
    m.kv_a_layernorm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.kv_lora_rank), jnp.float32)
    # Make k_pe matter: scale up the rope rows of kv_a so q_pe . k_pe is a sizeable part of the score.
    w = np.asarray(m.kv_a_proj_with_mqa.weight[...]).copy()
    w[cfg.kv_lora_rank :] *= 3.0
    m.kv_a_proj_with_mqa.weight[...] = jnp.asarray(w)
    return m


def p64(param) -> np.ndarray:
    return np.asarray(param[...], np.float64)


def np_rms(x: np.ndarray, gain: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if gain is None else y * gain


def np_sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def np_gated_mla(m: GatedMLA, cfg: K3Config, x: np.ndarray, *, q_eps: float = 1e-6, kv_eps: float = 1e-6) -> np.ndarray:
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, nope, rope, vd, r = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    cq = np_rms(x @ p64(m.q_a_proj.weight).T, p64(m.q_a_layernorm.weight), q_eps)
    q = (cq @ p64(m.q_b_proj.weight).T).reshape(b, t, h, nope + rope)
    ckv = x @ p64(m.kv_a_proj_with_mqa.weight).T  # [B, T, r + rope]
    c = np_rms(ckv[..., :r], p64(m.kv_a_layernorm.weight), kv_eps)
    k_pe = ckv[..., r:]  # shared by all heads, unnormalised, unrotated
    kv = (c @ p64(m.kv_b_proj.weight).T).reshape(b, t, h, nope + vd)  # head-major, K then V per head
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, :, None, :], (b, t, h, rope))], axis=-1)
    scores = np.einsum("bthd,bshd->bhts", q, k) * (nope + rope) ** -0.5
    causal = np.tril(np.ones((t, t), bool))
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", p, v).reshape(b, t, h * vd)
    o = o * np_sigmoid(x @ p64(m.g_proj.weight).T)
    return o @ p64(m.o_proj.weight).T


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def inputs(cfg: K3Config, t: int, seed: int = 0, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, t, cfg.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("t", [1, 7])
def test_forward_matches_numpy(mla: GatedMLA, cfg: K3Config, t: int) -> None:
    x = inputs(cfg, t, seed=t)
    out, cache = mla(jnp.asarray(x))
    assert cache is None and out.shape == x.shape and out.dtype == jnp.float32
    ref = np_gated_mla(mla, cfg, x)
    assert rel(out, ref) <= TOL
    # Causality: the output at token i does not depend on later tokens.
    x2 = x.copy()
    x2[:, -1] += 5.0
    out2, _ = mla(jnp.asarray(x2))
    np.testing.assert_array_equal(np.asarray(out2)[:, :-1], np.asarray(out)[:, :-1])


def test_reference_is_sensitive_to_structure(mla: GatedMLA, cfg: K3Config) -> None:
    """The low-rank norms' eps (1e-6, not rms_norm_eps 1e-5) only matters for small latents, so it is
    checked on down-scaled inputs, where the wrong eps moves the output by far more than TOL."""
    x = inputs(cfg, 7, seed=3)
    ref = np_gated_mla(mla, cfg, x)
    small = x * 1e-2  # latents with rms ~1e-2: eps 1e-5 vs 1e-6 then changes the normalisation by ~5%
    out_small, _ = mla(jnp.asarray(small))
    ref_small = np_gated_mla(mla, cfg, small)
    assert rel(out_small, ref_small) <= TOL
    assert rel(np_gated_mla(mla, cfg, small, q_eps=1e-5, kv_eps=1e-5), ref_small) > 10 * TOL
    assert rel(np_gated_mla(mla, cfg, x, q_eps=1.0), ref) > 10 * TOL


@pytest.mark.parametrize("prompt", [1, 3])
def test_prefill_then_decode_matches_full_forward(mla: GatedMLA, cfg: K3Config, prompt: int) -> None:
    total, capacity, batch = 7, 10, 2  # capacity > total: unwritten cache rows must stay masked
    x = jnp.asarray(inputs(cfg, total, seed=10 + prompt, batch=batch))
    full, _ = mla(x)

    cache = MLACache.empty(cfg, batch, capacity, jnp.float32)
    assert cache.latent.shape == (batch, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    # Put garbage in the not-yet-written rows: the causal mask must hide them.
    cache = MLACache(cache.latent + 1e3)
    step = nnx.jit(lambda m, xt, c, pos: m(xt, c, pos))
    outs = []
    out, cache = mla(x[:, :prompt], cache, 0)  # prefill (expanded form; absorbed if prompt == 1)
    outs.append(out)
    for pos in range(prompt, total):
        out, cache = step(mla, x[:, pos : pos + 1], cache, jnp.asarray(pos, jnp.int32))  # absorbed decode
        outs.append(out)
    stepped = jnp.concatenate(outs, axis=1)
    # Two fp32 evaluations of the same function by different contraction orders (absorbed: q W_UK
    # then . c; expanded: c W_UK then q .): each within ~1e-6 of exact, so <= 1e-5 of max|out|.
    assert rel(stepped, full) <= TOL
    assert rel(stepped, np_gated_mla(mla, cfg, np.asarray(x))) <= TOL
    assert cache.latent.shape == (batch, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_cache_holds_normalised_latent_and_raw_k_pe(mla: GatedMLA, cfg: K3Config) -> None:
    """Cache width kv_lora_rank + qk_rope_head_dim: [RMSNorm_1e-6(c_kv) * gain | k_pe], one row per token."""
    x = inputs(cfg, 4, seed=21)
    cache = MLACache.empty(cfg, 2, 6, jnp.float32)
    _, cache = mla(jnp.asarray(x), cache, 0)
    latent = np.asarray(cache.latent, np.float64)
    assert latent.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    r = cfg.kv_lora_rank
    ckv = x.astype(np.float64) @ p64(mla.kv_a_proj_with_mqa.weight).T
    expected = np.concatenate([np_rms(ckv[..., :r], p64(mla.kv_a_layernorm.weight), 1e-6), ckv[..., r:]], -1)
    assert rel(latent[:, :4], expected) <= TOL
    np.testing.assert_array_equal(latent[:, 4:], 0.0)


def test_prefill_attention_follows_the_kernel_choice(cfg: K3Config) -> None:
    """The expanded (prefill) path runs `Kernels.mla`: the blockwise "xla" implementation matches the
    numpy layer at T = 19, and a name no implementation has is refused."""
    m = GatedMLA(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3), kernels=Kernels(mla="xla"))
    x = inputs(cfg, 19, seed=5)
    out, _ = m(jnp.asarray(x))
    assert rel(out, np_gated_mla(m, cfg, x)) <= TOL
    m.kernels = Kernels(mla="no_such_kernel")
    with pytest.raises(ValueError, match="no_such_kernel"):
        m(jnp.asarray(x))


def test_context_split_layer_tells_the_dispatch(cfg: K3Config, monkeypatch) -> None:
    """A layer given a ContextParallel (its cache split over a mesh axis) says so to the prefill
    attention's dispatch, whose cuDNN entries refuse such a problem (test_mla_attention.py); the
    layer's own choice, `Kernels.mla`, is passed on unchanged."""
    asked = []
    real = mla_module.mla_prefill_attention

    def spy(*args, context_split, implementation, **kwargs):
        asked.append((context_split, implementation))
        return real(*args, context_split=context_split, implementation=implementation, **kwargs)

    monkeypatch.setattr(mla_module, "mla_prefill_attention", spy)
    x = jnp.asarray(inputs(cfg, 5, seed=2))
    m = GatedMLA(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    m(x)
    m.context_parallel = object()  # only its presence matters on the prefill path
    m(x)
    m.kernels = Kernels(mla="xla")
    m(x)
    assert asked == [(False, None), (True, None), (True, "xla")]
