"""The Mosaic GPU pair kernel (``mosaic_gpu/pairs.py``) in Mosaic GPU's CPU interpreter against
the fp32 chunk algebra, in the forward, and lowered for an abstract H200.

Tolerances: the kernel's products take bf16 operands and its Qg, Kd, bk, Aqk outputs are bf16, so
each value carries ~2^-9 relative rounding (RMS over a tensor ~1e-3); the pair sums add the
operands' rounding (measured 8e-4 relative against the Triton kernel on the H200). 5e-3 bounds
both with room, while a wrong factor, mask or block is off by O(1).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.chunk_math import C, causal_masks, pair_scores
from pallas_kernels.kda.gpu_backward import gpu_chunk_kda_bwd
from pallas_kernels.kda.gpu_config import chunk_config
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda
from pallas_kernels.kda.mosaic_gpu.pairs import intra_pairs_mgpu
from pallas_kernels.kda.reference import chunked_kda
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

B, T, H, K = 1, 2 * C, 2, 128
_BF16, _F32 = jnp.bfloat16, jnp.float32


def _chunk_reference(qs, k, g, beta):
    """``(L, bk, Qg, Kd, Aqk, gl)`` of one chunk in fp32 (``chunk_math``, HIGHEST products)."""
    causal, strict = causal_masks()
    G = jnp.cumsum(g, axis=0)
    b = beta[:, None]
    L = jnp.where(strict, b * pair_scores(k, k, G, _F32), 0.0)
    aqk = jnp.where(causal, pair_scores(qs, k, G, _F32), 0.0)
    eg = jnp.exp(G)
    return L, b * k * eg, qs * eg, k * jnp.exp(G[-1:] - G), aqk, jnp.exp(G[-1])


def _reference(qs, k, g, beta):
    """The chunk reference over [B, T, H, *] inputs, outputs in the kernel's layouts."""
    n = T // C
    split = lambda x: jnp.moveaxis(x.reshape(B, n, C, H, *x.shape[3:]), 3, 1)  # noqa: E731
    outs = jax.vmap(jax.vmap(jax.vmap(_chunk_reference)))(split(qs), split(k), split(g), split(beta))
    merge = lambda x: jnp.moveaxis(x, 1, 3).reshape(B, T, H, -1)  # noqa: E731
    L, bk, qg, kd, aqk, gl = outs
    return merge(L), merge(bk), merge(qg), merge(kd), merge(aqk), jnp.moveaxis(gl, 1, 2)


def _inputs(lower_bound: float, seed: int, k_dim: int = K) -> dict[str, jax.Array]:
    x = as_f32(kda_case(np.random.default_rng(seed), B, T, H, k_dim, k_dim, lower_bound))
    return {n: a.astype(_BF16) for n, a in x.items()}


# "bound": steps near -5, the factorisation's tightest case (e^{G_last} underflows to 0);
# "mild": small decays, so e^{G_last} and the far pairs stay well inside fp32's range.
# K = 64: one swizzle tile of channels instead of two; "fp32 gate": the gate read in fp32, one
# channel half at a time.
@pytest.mark.parametrize("lower_bound, k_dim, gate_dtype",
                         [(-5.0, K, _BF16), (-0.3, K, _BF16), (-5.0, 64, _BF16), (-5.0, K, _F32)],
                         ids=["bound", "mild", "K64", "fp32 gate"])
def test_pre_activated_inputs_match_the_chunk_algebra(lower_bound: float, k_dim: int,
                                                      gate_dtype) -> None:
    x = _inputs(lower_bound, seed=1, k_dim=k_dim)
    if gate_dtype == _F32:  # a gate off the bf16 grid, as the model makes it
        x["g"] = lower_bound * jax.nn.sigmoid(jnp.asarray(
            np.random.default_rng(9).standard_normal(x["g"].shape), _F32))
    scale = k_dim**-0.5
    got = intra_pairs_mgpu((x["q"], x["k"], x["v"], x["g"], x["beta"]), scale=scale, fused=False,
                           lower_bound=lower_bound, interpret=True)
    f32 = {n: a.astype(_F32) for n, a in x.items()}
    want = _reference(f32["q"] * scale, f32["k"], f32["g"], f32["beta"])
    for name, a, b in zip(("L", "bk", "Qg", "Kd", "Aqk", "gl"), got, want):
        assert a.shape == b.shape, name
        assert rel(a.astype(_F32), b, floor=1e-20) <= 5e-3, name
    assert got[0].dtype == _F32 and got[5].dtype == _F32 and got[4].dtype == _BF16


def test_fused_activations_match_the_chunk_algebra() -> None:
    """Raw q, k (L2 norm in the kernel), the gate pre-activation with K3's per-head scale and
    bias, and beta logits."""
    rng = np.random.default_rng(2)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), _F32)  # noqa: E731
    q, k, g_raw = (f(B, T, H, K).astype(_BF16) for _ in range(3))
    b_logit = f(B, T, H).astype(_BF16)
    gate_scale = jnp.exp(0.5 * f(H, 1)) * jnp.ones((H, K), _F32)
    dt_bias = 0.5 * f(H, K)
    scale = 0.1
    got = intra_pairs_mgpu((q, k, q, g_raw, b_logit, gate_scale, dt_bias), scale=scale,
                           fused=True, lower_bound=-5.0, interpret=True)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    g = -5.0 * jax.nn.sigmoid(gate_scale * (g_raw.astype(_F32) + dt_bias))
    want = _reference(l2(q.astype(_F32)) * scale, l2(k.astype(_F32)), g,
                      jax.nn.sigmoid(b_logit.astype(_F32)))
    for name, a, b in zip(("L", "bk", "Qg", "Kd", "Aqk", "gl"), got, want):
        assert rel(a.astype(_F32), b, floor=1e-20) <= 5e-3, name


def test_forward_default_takes_it_and_matches_the_reference() -> None:
    """bf16 with K = 128 takes the Mosaic GPU pair kernel by default; T = 65 pads the last chunk.
    Same bound as the Triton path's bf16 test (2e-2: bf16 rounding of every intermediate), and
    within bf16 rounding of the Triton pair kernel's forward."""
    x = as_f32(kda_case(np.random.default_rng(3), B, 65, H, K, 64))
    q, k, v, g = (x[n].astype(_BF16) for n in ("q", "k", "v", "g"))
    pairs = lambda *a: chunk_config(*a).pairs  # noqa: E731
    assert pairs(q, k, v, g) == "mosaic_gpu" == pairs(q, k, v, x["g"])
    assert pairs(x["q"], x["k"], x["v"], x["g"]) == "triton"
    assert pairs(q[..., :32], k[..., :32], v, g[..., :32]) == "triton"
    run = lambda pairs: gpu_chunk_kda(  # noqa: E731
        q, k, v, g, x["beta"], initial_state=x["s0"],
        config=chunk_config(q, k, v, g, pairs=pairs))
    o, s = run(None)
    o_tri, s_tri = run("triton")
    ref_o, ref_s = chunked_kda(q.astype(_F32), k.astype(_F32), v.astype(_F32), g.astype(_F32),
                               x["beta"], scale=K**-0.5, initial_state=x["s0"])
    assert rel(o.astype(_F32), ref_o) <= 2e-2 and rel(s, ref_s) <= 2e-2
    assert rel(o.astype(_F32), o_tri.astype(_F32)) <= 5e-3 and rel(s, s_tri) <= 5e-3


def test_kept_intra_backward_equals_the_recomputing_one() -> None:
    """With the Mosaic GPU pair kernel in the forward, the backward from the kept (X, Aqk) and
    the one that recomputes them give the same gradients bit for bit."""
    x = as_f32(kda_case(np.random.default_rng(4), B, T, 1, K, 64))
    q, k, v, g = (x[n].astype(_BF16) for n in ("q", "k", "v", "g"))
    args = (q, k, v, g, x["beta"], x["s0"][:, :1])
    *_, intra = gpu_chunk_kda(*args[:5], initial_state=args[5], return_intra=True)
    rng = np.random.default_rng(5)
    do = jnp.asarray(rng.standard_normal(v.shape), _BF16)
    dht = jnp.asarray(rng.standard_normal(args[5].shape), _F32)
    got = gpu_chunk_kda_bwd(*args, do, dht, scale=K**-0.5, intra=intra)
    want = gpu_chunk_kda_bwd(*args, do, dht, scale=K**-0.5)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("fused, gate_dtype", [(False, _BF16), (True, _BF16), (False, _F32)])
def test_lowers_for_h200(fused: bool, gate_dtype) -> None:
    """The kernel passes Pallas -> Mosaic GPU lowering (layout inference included) for an H200:
    one Mosaic GPU custom call carrying the kernel's name."""
    S = jax.ShapeDtypeStruct
    ins = [S((B, 4 * C, H, K), _BF16)] * 3 + [S((B, 4 * C, H, K), gate_dtype)]
    ins += [S((B, 4 * C, H), _BF16)]
    ins += [S((H, K), _F32)] * 2 if fused else []
    text = lowered_for_h200(lambda *a: intra_pairs_mgpu(a, scale=0.1, fused=fused,
                                                        lower_bound=-5.0, interpret=False), *ins)
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 1
    assert "kda_intra_pairs_mgpu" in text


def test_rejects_inputs_it_cannot_take() -> None:
    x = _inputs(-5.0, seed=6)
    ins = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"^mosaic_gpu_pairs: wants bf16 q, k"):
        intra_pairs_mgpu(tuple(a.astype(_F32) for a in ins), scale=1.0, fused=False,
                         lower_bound=-5.0, interpret=True)
    with pytest.raises(ValueError, match=r"^mosaic_gpu_pairs: wants bf16 q, k .* g float16"):
        intra_pairs_mgpu(ins[:3] + (ins[3].astype(jnp.float16), ins[4]), scale=1.0, fused=False,
                         lower_bound=-5.0, interpret=True)
    small = tuple(a[..., :32] if a.ndim == 4 else a for a in ins)
    with pytest.raises(ValueError, match=r"^pairs='mosaic_gpu' needs bf16 q, k, v, a bf16 or "):
        chunk_config(*small[:4], pairs="mosaic_gpu")
    with pytest.raises(ValueError, match=r"^pairs: expected one of \('triton', 'mosaic_gpu'\)"):
        chunk_config(*ins[:4], pairs="cuda")


def test_packed_sequences() -> None:
    """Packed sequences (``cu_seqlens``) run the pair kernel on the chunk-aligned layout: the
    same bounds as the padded forward, against the reference and the Triton pair kernel."""
    lens = (1, 63, 65)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = as_f32(kda_case(np.random.default_rng(7), 1, int(cu[-1]), H, 64, 64, states=len(lens)))
    q, k, v = (x[n].astype(_BF16) for n in ("q", "k", "v"))
    run = lambda pairs: gpu_chunk_kda(  # noqa: E731
        q, k, v, x["g"], x["beta"], initial_state=x["s0"], cu_seqlens=cu,
        config=chunk_config(q, k, v, x["g"], cu_seqlens=cu, pairs=pairs))
    (o, s), (o_tri, s_tri) = run(None), run("triton")
    ref_o, ref_s = chunked_kda(q.astype(_F32), k.astype(_F32), v.astype(_F32), x["g"], x["beta"],
                               scale=64**-0.5, initial_state=x["s0"], cu_seqlens=cu)
    assert rel(o.astype(_F32), ref_o) <= 2e-2 and rel(s, ref_s) <= 2e-2
    assert rel(o.astype(_F32), o_tri.astype(_F32)) <= 5e-3 and rel(s, s_tri) <= 5e-3
