"""Every implementation of both KDA tables that runs on CPU, through the public ops, against
independent references: "xla", "pallas_gpu" (Pallas interpret mode) and "mosaic_tpu" (TPU
interpret mode). Plus the policy's defaults per platform and the dispatch errors.

Tolerance (relative L2, fp32 everywhere with IEEE products): the chunked forms (midpoint-factored
decays, block inverses or triangular solves, analytic or autodiff backwards) reorder the sums of
the token-by-token references; the kernel tests see them within ~1e-5. 1e-4 leaves a margin,
while a wrong mask, decay, activation or gradient term is off by 1e-2 or more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dispatch import choose
from pallas_kernels.kda import (
    CHUNK_IMPLEMENTATIONS, DECODE_IMPLEMENTATIONS, chunk_kda, chunk_kda_fused, kda_decode,
    naive_recurrent_kda, recurrent_kda_step,
)
from pallas_kernels.platform import target
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

B, T, H, K, V = 2, 70, 2, 32, 64  # 70 tokens: a padded second chunk; K != V
LB = -5.0
TOL = 1e-4
CHUNK = list(CHUNK_IMPLEMENTATIONS)
DECODE = list(DECODE_IMPLEMENTATIONS)


def _grads(fn, args, cot_o, cot_s):
    """``(loss, gradients of every argument)`` of ``<o, cot_o> + <state, cot_s>``."""
    def loss(*a):
        o, s = fn(*a)
        return jnp.sum(o * cot_o) + jnp.sum(s * cot_s)

    return jax.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)


def _cotangents(o_shape, s_shape, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(o_shape), jnp.float32),
            jnp.asarray(rng.standard_normal(s_shape), jnp.float32))


@pytest.mark.parametrize("name", CHUNK)
def test_chunk_kda_forward_and_gradients(name: str) -> None:
    """Pre-activated inputs: o, the final state and the gradients of q, k, v, g, beta and the
    initial state against autodiff of the token-by-token recurrence."""
    x = as_f32(kda_case(np.random.default_rng(1), B, T, H, K, V, LB))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"])
    cot = _cotangents((B, T, H, V), (B, H, K, V), seed=2)
    run = lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,  # noqa: E731
                               lower_bound=LB, implementation=name)
    ref = lambda *a: naive_recurrent_kda(*a[:5], initial_state=a[5])  # noqa: E731
    (o, s), (o_ref, s_ref) = run(*args), ref(*args)
    assert o.shape == (B, T, H, V) and o.dtype == jnp.float32 and s.shape == (B, H, K, V)
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL
    (_, grads), (_, want) = _grads(run, args, *cot), _grads(ref, args, *cot)
    for arg, got, expected in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, want):
        assert rel(got, expected) <= TOL, arg


def _raw_inputs(seed: int, batch: int, t: int) -> dict[str, jax.Array]:
    """K3's raw inputs: q, k, gate pre-activation, beta logits, A_log zero-padded past H (as K3's
    checkpoint stores it), dt_bias, and an initial state."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(q=f(batch, t, H, K), k=f(batch, t, H, K), v=f(batch, t, H, V),
                g=f(batch, t, H, K), beta=f(batch, t, H),
                A_log=jnp.concatenate([jnp.asarray(rng.uniform(-1, 1, H), jnp.float32),
                                       jnp.zeros(2, jnp.float32)]),
                dt_bias=0.5 * f(H * K), s0=0.5 * f(batch, H, K, V))


def _fused_reference(q, k, v, g_raw, beta_logits, A_log, dt_bias, s0, cu_seqlens=None):
    """The activations written out here (not the package's) and the token-by-token recurrence,
    one packed sequence at a time."""
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    g = LB * jax.nn.sigmoid(jnp.exp(A_log[:H])[:, None] * (g_raw + dt_bias.reshape(H, K)))
    args = (l2(q), l2(k), v, g, jax.nn.sigmoid(beta_logits))
    if cu_seqlens is None:
        return naive_recurrent_kda(*args, initial_state=s0)
    outs, states = [], []
    for i in range(len(cu_seqlens) - 1):
        piece = [a[:, cu_seqlens[i]:cu_seqlens[i + 1]] for a in args]
        o, s = naive_recurrent_kda(*piece, initial_state=s0[i:i + 1])
        outs.append(o)
        states.append(s)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(states)


FUSED_ARGS = ("q_raw", "k_raw", "v", "g_raw", "beta_logits", "A_log", "dt_bias", "initial_state")


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("name", CHUNK)
def test_chunk_kda_fused_forward_and_gradients(name: str, packed: bool) -> None:
    """K3's raw inputs, activations in the op: o, the final state and the gradients of every
    input, A_log (zero-padded past H: zero gradient there) and dt_bias included."""
    cu = np.array([0, 5, 64, 70]) if packed else None
    batch = 1 if packed else B
    x = _raw_inputs(3, batch, T)
    s0 = x["s0"] if not packed else jnp.asarray(
        0.5 * np.random.default_rng(9).standard_normal((3, H, K, V)), jnp.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], s0)
    cot = _cotangents((batch, T, H, V), s0.shape, seed=4)
    run = lambda *a: chunk_kda_fused(  # noqa: E731
        *a[:7], lower_bound=LB, initial_state=a[7], output_final_state=True, cu_seqlens=cu,
        implementation=name)
    ref = lambda *a: _fused_reference(*a, cu_seqlens=cu)  # noqa: E731
    (o, s), (o_ref, s_ref) = run(*args), ref(*args)
    assert o.shape == (batch, T, H, V) and s.shape == s0.shape
    assert rel(o, o_ref) <= TOL and rel(s, s_ref) <= TOL
    (_, grads), (_, want) = _grads(run, args, *cot), _grads(ref, args, *cot)
    for arg, got, expected in zip(FUSED_ARGS, grads, want):
        assert got.shape == expected.shape, arg
        assert rel(got, expected) <= TOL, arg
    assert not jnp.any(grads[5][H:])  # A_log's padding


@pytest.mark.parametrize("name", CHUNK)
def test_chunk_kda_fused_identity_steps(name: str) -> None:
    """Steps with -inf gate and beta logits and zero q, k, v (how the model writes left padding)
    leave the state untouched: the output after them and every gradient are those of the run
    without them, and no gradient is NaN (the activations must not form 0 * inf)."""
    pad = 6
    x = _raw_inputs(5, 1, T)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["s0"])

    def padded(q, k, v, g_raw, beta_logits, *rest):
        zeros = lambda a: jnp.concatenate([jnp.zeros((1, pad) + a.shape[2:]), a], 1)  # noqa: E731
        minus_inf = lambda a: jnp.concatenate(  # noqa: E731
            [jnp.full((1, pad) + a.shape[2:], -jnp.inf), a], 1)
        o, s = chunk_kda_fused(zeros(q), zeros(k), zeros(v), minus_inf(g_raw),
                               minus_inf(beta_logits), *rest[:2], lower_bound=LB,
                               initial_state=rest[2], output_final_state=True,
                               implementation=name)
        return o[:, pad:], s

    plain = lambda *a: chunk_kda_fused(  # noqa: E731
        *a[:7], lower_bound=LB, initial_state=a[7], output_final_state=True, implementation=name)
    cot = _cotangents((1, T, H, V), (1, H, K, V), seed=6)
    (loss, grads), (loss_ref, want) = _grads(padded, args, *cot), _grads(plain, args, *cot)
    assert abs(float(loss) - float(loss_ref)) <= TOL * abs(float(loss_ref))
    for arg, got, expected in zip(FUSED_ARGS, grads, want):
        assert bool(jnp.isfinite(got).all()), arg
        assert rel(got, expected) <= TOL, arg


@pytest.mark.parametrize("name", DECODE)
def test_kda_decode(name: str) -> None:
    """One decode step against the reference step, fp32 (exact products on every backend)."""
    x = as_f32(kda_case(np.random.default_rng(7), B, 1, H, K, V, LB))
    step = [x[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
    o, s = kda_decode(*step, x["s0"], implementation=name)
    o_ref, s_ref = recurrent_kda_step(*step, x["s0"])
    assert o.shape == (B, H, V) and s.shape == (B, H, K, V)
    assert rel(o, o_ref) <= 1e-6 and rel(s, s_ref) <= 1e-6


@pytest.mark.parametrize("platform, lower_bound, width, chunk, decode", [
    ("gpu", LB, 128, "pallas_gpu", "pallas_gpu"),
    ("gpu", None, 128, "xla", "pallas_gpu"),  # no safe gate: no chunk kernel
    ("gpu", -6.0, 128, "xla", "pallas_gpu"),
    ("gpu", LB, 96, "xla", "xla"),  # Triton wants powers of two
    ("cpu", LB, 128, "xla", "xla"),
    ("tpu", LB, 128, "xla", "xla"),  # Mosaic TPU has not run on hardware: never a default
])
def test_policy_defaults(platform, lower_bound, width, chunk, decode) -> None:
    with target(platform):
        got = choose("chunk_kda", CHUNK_IMPLEMENTATIONS, None, lower_bound=lower_bound, K=width,
                     V=width)
        assert got.name == chunk
        assert choose("kda_decode", DECODE_IMPLEMENTATIONS, None, K=width, V=width).name == decode


def test_dispatch_errors_name_what_is_wrong() -> None:
    x = as_f32(kda_case(np.random.default_rng(8), 1, 8, H, K, V, LB))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    step = [a[:, 0] for a in args]
    with pytest.raises(ValueError, match=r"^chunk_kda: implementation 'pallas' is unknown; "
                                         r"expected one of \('pallas_gpu', 'mosaic_tpu', 'xla'\)"):
        chunk_kda(*args, lower_bound=LB, implementation="pallas")
    with pytest.raises(NotImplementedError, match=r"^chunk_kda: implementation 'pallas_gpu' cannot "
                                                  r"run this problem: .*lower_bound=None"):
        chunk_kda(*args, implementation="pallas_gpu")
    with pytest.raises(NotImplementedError, match=r"^chunk_kda_fused: implementation "
                                                  r"'mosaic_tpu' cannot run .*lower_bound=-6.0"):
        chunk_kda_fused(*args, jnp.zeros(H), jnp.zeros(H * K), lower_bound=-6.0,
                        implementation="mosaic_tpu")
    with target("tpu"), pytest.raises(
            NotImplementedError, match=r"^chunk_kda: implementation 'pallas_gpu' runs on "
                                       r"\['cpu', 'gpu'\], not 'tpu'"):
        chunk_kda(*args, lower_bound=LB, implementation="pallas_gpu")
    with target("gpu"), pytest.raises(
            NotImplementedError, match=r"^kda_decode: implementation 'pallas_gpu' cannot run "
                                       r"this problem: .*powers of two .*K=24"):
        kda_decode(*(a[..., :24] if a.ndim == 3 and i != 2 else a for i, a in enumerate(step)),
                   x["s0"][:, :, :24], implementation="pallas_gpu")
    with pytest.raises(ValueError, match=r"^dt_bias: expected shape \(64,\)"):
        chunk_kda_fused(*args, jnp.zeros(H), jnp.zeros(3), lower_bound=LB)
