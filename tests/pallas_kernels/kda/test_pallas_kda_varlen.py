"""Packed variable-length sequences (``cu_seqlens``) in the safe-gate GPU KDA forward.

Interpret mode on CPU against the exact chunked reference, plus the per-sequence independence
that defines varlen: each packed sequence's output and final state equal running it alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.gpu_config import chunk_config
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda, gpu_chunk_kda_fused
from pallas_kernels.kda.reference import chunked_kda
from pallas_kernels.kda.varlen_layout import chunk_layout
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

H, K, V = 2, 32, 64  # K != V on purpose
LB = -5.0
MIXES = [(1, 63, 64, 65, 130), (130, 0, 1), (64, 64), (65,), (2, 3, 5)]


def packed_inputs(lens: tuple[int, ...], seed: int = 0) -> tuple[dict[str, jax.Array], np.ndarray]:
    """K3-like fp32 packed inputs [1, T, ...], per-sequence initial states, and cu_seqlens."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = kda_case(np.random.default_rng(seed), 1, int(cu[-1]), H, K, V, LB, states=len(lens))
    return as_f32(x), cu


def _args(x: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def test_layout_aligns_every_sequence_to_a_chunk() -> None:
    offsets = np.array([0, 1, 64, 64, 130])
    lay = chunk_layout(offsets, 64)
    assert list(lay.chunk_offsets) == [0, 1, 2, 2, 4]
    assert lay.src.size == 4 * 64 and lay.src.size <= 130 + 4 * 63
    assert list(lay.dst[:2]) == [0, 64] and lay.dst[64] == 128 and lay.dst[-1] == 128 + 65
    pad = np.setdiff1d(np.arange(lay.src.size), lay.dst)
    assert (lay.src[pad] == 130).all() and (lay.src[lay.dst] == np.arange(130)).all()


@pytest.mark.parametrize("lens", MIXES)
def test_matches_reference(lens: tuple[int, ...]) -> None:
    x, cu = packed_inputs(lens, seed=sum(lens))
    o, s = gpu_chunk_kda(*_args(x), initial_state=x["s0"], cu_seqlens=cu)
    ref_o, ref_s = chunked_kda(*_args(x), scale=K**-0.5, initial_state=x["s0"], cu_seqlens=cu)
    assert o.shape == (1, cu[-1], H, V) and s.shape == (len(lens), H, K, V)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert rel(o, ref_o) <= 1e-5
    assert rel(s, ref_s) <= 1e-5


@pytest.mark.parametrize("lens", MIXES[:2])
def test_two_pass_inter_stage_matches_reference(lens: tuple[int, ...]) -> None:
    """The two-pass inter stage on packed sequences: per-sequence chunk ranges in the recurrence,
    every chunk's o from its own stored state."""
    x, cu = packed_inputs(lens, seed=sum(lens))
    o, s = gpu_chunk_kda(*_args(x), initial_state=x["s0"], cu_seqlens=cu,
                         config=chunk_config(*_args(x)[:4], cu_seqlens=cu, inter="two_pass"))
    ref_o, ref_s = chunked_kda(*_args(x), scale=K**-0.5, initial_state=x["s0"], cu_seqlens=cu)
    assert o.shape == (1, cu[-1], H, V) and s.shape == (len(lens), H, K, V)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert rel(o, ref_o) <= 1e-5
    assert rel(s, ref_s) <= 1e-5


def test_equals_each_sequence_alone() -> None:
    """No state crosses a boundary: packed results are the per-sequence runs, to fp32 rounding."""
    lens = MIXES[0]
    x, cu = packed_inputs(lens, seed=11)
    o, s = gpu_chunk_kda(*_args(x), initial_state=x["s0"], cu_seqlens=cu)
    for i in range(len(lens)):
        piece = [a[:, cu[i]:cu[i + 1]] for a in _args(x)]
        o_i, s_i = gpu_chunk_kda(*piece, initial_state=x["s0"][i:i + 1])
        assert rel(o[:, cu[i]:cu[i + 1]], o_i) <= 1e-6, i
        assert rel(s[i], s_i[0]) <= 1e-6, i


def test_without_initial_state() -> None:
    x, cu = packed_inputs((65, 3), seed=5)
    o, s = gpu_chunk_kda(*_args(x), cu_seqlens=cu)
    ref_o, ref_s = chunked_kda(*_args(x), scale=K**-0.5, initial_state=None, cu_seqlens=cu)
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5


def test_fused_gate_pads_with_identity_steps() -> None:
    """The fused activations pad gate / beta logits with -inf: padding still writes nothing."""
    lens = (70, 1, 64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    T = int(cu[-1])
    rng = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v, g_raw, b_logit = f(1, T, H, K), f(1, T, H, K), f(1, T, H, V), f(1, T, H, K), \
        f(1, T, H)
    A_log, dt_bias, s0 = 0.5 * f(H), 0.5 * f(H * K), 0.5 * f(len(lens), H, K, V)
    o, s = gpu_chunk_kda_fused(q, k, v, g_raw, b_logit, A_log, dt_bias, lower_bound=LB,
                               initial_state=s0, cu_seqlens=cu)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    g = LB * jax.nn.sigmoid(jnp.exp(A_log)[:, None] * (g_raw + dt_bias.reshape(H, K)))
    ref_o, ref_s = chunked_kda(l2(q), l2(k), v, g, jax.nn.sigmoid(b_logit), scale=K**-0.5,
                               initial_state=s0, cu_seqlens=cu)
    assert rel(o, ref_o) <= 1e-5 and rel(s, ref_s) <= 1e-5


def test_api_forward_and_gradients() -> None:
    """chunk_kda(implementation="pallas_gpu", cu_seqlens=...) equals the XLA path, gradients too."""
    x, cu = packed_inputs((70, 1, 20), seed=9)
    cot = jax.random.normal(jax.random.key(0), x["v"].shape)

    def loss(implementation, q, k, v, g, beta, s0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                         cu_seqlens=cu, implementation=implementation, lower_bound=LB)
        return jnp.sum(o * cot) + jnp.sum(s * s0)

    args = (*_args(x), x["s0"])
    assert rel(loss("pallas_gpu", *args), loss("xla", *args)) <= 1e-5
    grads = jax.grad(lambda *a: loss("pallas_gpu", *a), argnums=range(6))(*args)
    expected = jax.grad(lambda *a: loss("xla", *a), argnums=range(6))(*args)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "s0"), grads, expected):
        assert rel(got, want) <= 1e-5, name


def test_validation() -> None:
    x, cu = packed_inputs((10, 5), seed=1)
    two = [jnp.concatenate([a, a]) for a in _args(x)]
    with pytest.raises(ValueError, match="^cu_seqlens:.*B == 1"):
        gpu_chunk_kda(*two, cu_seqlens=cu)
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        gpu_chunk_kda(*_args(x), cu_seqlens=np.array([0, 4, 9]))
    with pytest.raises(ValueError, match=r"^initial_state: .*\[N, H, K, V\]"):
        gpu_chunk_kda(*_args(x), initial_state=x["s0"][:1], cu_seqlens=cu)


@pytest.mark.parametrize("inter, kernels", [("fused", 3), ("two_pass", 5)])
def test_lowers_to_triton_for_h200(inter: str, kernels: int) -> None:
    """Cross-lowering for an abstract H200 on CPU: every kernel (the intra stage's pair and
    inverse kernels, and the fused inter kernel forming W and U in its loop with its
    data-dependent chunk range, or the W/U kernel and the two-pass stage's recurrence and output
    kernels) passes the Pallas -> Triton IR step (no PTX compile)."""
    f = jax.ShapeDtypeStruct
    T, cu = 200, np.array([0, 1, 70, 200])
    args = (f((1, T, H, K), jnp.bfloat16), f((1, T, H, K), jnp.bfloat16),
            f((1, T, H, V), jnp.bfloat16), f((1, T, H, K), jnp.float32), f((1, T, H), jnp.float32),
            f((3, H, K, V), jnp.float32))
    config = chunk_config(*args[:4], cu_seqlens=cu, inter=inter)
    fn = lambda q, k, v, g, b, s0: gpu_chunk_kda(  # noqa: E731
        q, k, v, g, b, initial_state=s0, cu_seqlens=cu, config=config)
    text = lowered_for_h200(fn, *args)
    assert text.count("stablehlo.custom_call @__gpu") == kernels
