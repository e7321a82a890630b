"""The pure-JAX KDA references agree with each other and with an independent float64 loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, kda_decode, naive_recurrent_kda, recurrent_kda_step
from tests.pallas_kernels.kda.kda_cases import kda_case

B, H, K, V = 2, 3, 16, 24  # K != V on purpose


def make_inputs(T: int, seed: int = 0, batch: int = B) -> dict[str, np.ndarray]:
    """float64 inputs shaped like K3's: unit q/k, gate in (-5, 0), beta in (0, 1)."""
    return kda_case(np.random.default_rng(seed), batch, T, H, K, V, gate_spread=1.0, state_scale=1.0)


def f32(x: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {name: jnp.asarray(a, jnp.float32) for name, a in x.items()}


def rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@jax.jit
def chunked(q, k, v, g, beta, s0):
    return chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)


@jax.jit
def naive(q, k, v, g, beta, s0):
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)


def _args(x: dict[str, jax.Array], with_state: bool = True) -> tuple:
    return x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"] if with_state else None


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 150, 300])
def test_chunked_matches_naive_recurrent(T: int, with_state: bool) -> None:
    x = f32(make_inputs(T))
    o, s = chunked(*_args(x, with_state))
    o_ref, s_ref = naive(*_args(x, with_state))
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert rel(o, o_ref) <= 1e-5
    assert rel(s, s_ref) <= 1e-5


def test_chunked_matches_naive_slow_decay() -> None:
    """With g in (-0.05, 0) the initial state and the inter-chunk carry survive to T."""
    x = make_inputs(300, seed=9)
    x = f32({**x, "g": x["g"] / 100})
    o, s = chunked(*_args(x))
    o_ref, s_ref = naive(*_args(x))
    assert rel(o, o_ref) <= 1e-5
    assert rel(s, s_ref) <= 1e-5


def test_naive_matches_float64_loop() -> None:
    x64 = make_inputs(70, seed=1)
    q, k, v, g, beta, S = x64["q"], x64["k"], x64["v"], x64["g"], x64["beta"], x64["s0"].copy()
    o = np.zeros_like(v)
    for t in range(v.shape[1]):
        S = S * np.exp(g[:, t])[..., None]
        err = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + np.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], err)
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S)
    o_ref, s_ref = naive(*_args(f32(x64)))
    assert rel(o_ref, o) <= 1e-5
    assert rel(s_ref, S) <= 1e-5


def test_decode_step_iterated_matches_naive() -> None:
    x = f32(make_inputs(20, seed=2))
    step = jax.jit(recurrent_kda_step)
    state, outs = x["s0"], []
    for t in range(20):
        o_t, state = step(*(a[:, t] for a in _args(x)[:5]), state)
        outs.append(o_t)
    o_ref, s_ref = naive(*_args(x))
    assert rel(jnp.stack(outs, axis=1), o_ref) <= 1e-5
    assert rel(state, s_ref) <= 1e-5
    o_api, s_api = kda_decode(*(a[:, 0] for a in _args(x)[:5]), x["s0"])
    o_ref1, s_ref1 = naive(*(a[:, :1] for a in _args(x)[:5]), x["s0"])
    assert rel(o_api, o_ref1[:, 0]) <= 1e-5 and rel(s_api, s_ref1) <= 1e-5


@pytest.mark.parametrize("T", [65, 150])
def test_gradients_match_naive(T: int) -> None:
    x = f32(make_inputs(T, seed=3))
    rng = np.random.default_rng(4)
    co = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    cs = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)

    def loss(fn, *args):
        o, s = fn(*args)
        return jnp.sum(o * co) + jnp.sum(s * cs)

    argnums = tuple(range(6))
    grads = jax.jit(jax.grad(functools.partial(loss, chunked), argnums))(*_args(x))
    grads_ref = jax.jit(jax.grad(functools.partial(loss, naive), argnums))(*_args(x))
    for name, gr, gr_ref in zip(("q", "k", "v", "g", "beta", "s0"), grads, grads_ref):
        assert np.all(np.isfinite(gr)), name
        assert rel(gr, gr_ref) <= 1e-4, name


def test_cu_seqlens_matches_separate_sequences() -> None:
    lens = [5, 64, 70]
    x = f32(make_inputs(sum(lens), seed=5, batch=1))
    s0 = jnp.asarray(np.random.default_rng(6).standard_normal((len(lens), H, K, V)), jnp.float32)
    cu = np.cumsum([0, *lens]).astype(np.int32)
    o, s = chunk_kda(*_args(x)[:5], initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, sum(lens), H, V) and s.shape == (len(lens), H, K, V)
    for n in range(len(lens)):
        seg = [a[:, cu[n] : cu[n + 1]] for a in _args(x)[:5]]
        o_n, s_n = chunked(*seg, s0[n : n + 1])
        assert rel(o[:, cu[n] : cu[n + 1]], o_n) <= 1e-6
        assert rel(s[n : n + 1], s_n) <= 1e-6


def test_cu_seqlens_must_be_concrete() -> None:
    x = f32(make_inputs(10, batch=1))
    fn = jax.jit(lambda cu: chunk_kda(*_args(x)[:5], cu_seqlens=cu)[0])
    with pytest.raises(ValueError, match="cu_seqlens must be concrete"):
        fn(jnp.array([0, 4, 10], jnp.int32))


def test_identity_steps_leave_state_unchanged() -> None:
    x = f32(make_inputs(40, seed=7))
    _, s = chunked(*_args(x))
    padded = {
        name: jnp.concatenate([a, jnp.zeros((B, 30) + a.shape[2:], a.dtype)], axis=1)
        for name, a in x.items()
        if name != "s0"
    }
    _, s_pad = chunked(*_args({**padded, "s0": x["s0"]}))
    assert rel(s_pad, s) <= 1e-6


def _bad_inputs(x: dict[str, jax.Array], name: str, value: jax.Array) -> dict:
    kw = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["s0"])
    kw[name] = value
    return kw


@pytest.mark.parametrize(
    "name, make_bad",
    [
        ("q", lambda x: x["q"][0]),
        ("k", lambda x: x["k"][..., :8]),
        ("v", lambda x: x["v"][:, :3]),
        ("g", lambda x: x["g"][:, :, :2]),
        ("beta", lambda x: x["beta"][..., None]),
        ("initial_state", lambda x: x["s0"][..., :5]),
        ("initial_state", lambda x: x["s0"].astype(jnp.bfloat16)),
    ],
)
def test_chunk_kda_validation(name: str, make_bad) -> None:
    x = f32(make_inputs(4))
    kw = _bad_inputs(x, name, make_bad(x))
    with pytest.raises(ValueError, match=f"^{name}:"):
        chunk_kda(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)


def test_dispatch_and_cu_seqlens_validation() -> None:
    x = f32(make_inputs(10))
    args = _args(x)[:5]
    with pytest.raises(NotImplementedError, match="unbounded gate"):
        chunk_kda(*args, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="^chunk_kda: implementation 'triton' is unknown"):
        chunk_kda(*args, implementation="triton")
    with pytest.raises(ValueError, match="^cu_seqlens:.*B == 1"):
        chunk_kda(*args, cu_seqlens=np.array([0, 10]))
    one = [a[:1] for a in args]
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        chunk_kda(*one, cu_seqlens=np.array([0, 4, 9]))  # does not end at T
    with pytest.raises(ValueError, match="^initial_state:"):
        chunk_kda(*one, cu_seqlens=np.array([0, 4, 10]), initial_state=x["s0"][:1])  # needs N=2


def test_kda_decode_validation() -> None:
    x = f32(make_inputs(1))
    step = [a[:, 0] for a in _args(x)[:5]]
    with pytest.raises(ValueError, match="^state:"):
        kda_decode(*step, x["s0"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="^beta:"):
        kda_decode(*step[:4], step[4][:, :1], x["s0"])


def test_bf16_inputs() -> None:
    x = f32(make_inputs(70, seed=8))
    bf = {**x, **{n: x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")}}
    o, s = chunked(*_args(bf))
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o_ref, s_ref = naive(*_args(bf))
    assert o_ref.dtype == jnp.bfloat16
    assert rel(o, o_ref) <= 1e-2 and rel(s, s_ref) <= 1e-5


@pytest.mark.parametrize("T", [5, 7, 8, 12, 20])
def test_jitted_chunked_without_initial_state(T):
    """Regression: XLA:CPU (jaxlib 0.11.2) returned garbage for a jitted chunked KDA whose state is a
    constant zero and whose final state is unused, unless the state goes through a barrier."""
    x = f32(make_inputs(T, seed=T, batch=1))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o = jax.jit(lambda *a: chunk_kda(*a)[0])(*args)
    expected, _ = naive_recurrent_kda(*args)
    assert rel(o, expected) <= 1e-5
