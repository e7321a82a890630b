"""The segmented inter stage (``mosaic_gpu/segmented_inter.py``) and its first pass
(``states_mgpu``) in Mosaic GPU's CPU interpreter, against the unsegmented Mosaic GPU inter kernel
and the fp32 reference, and lowered for an abstract H200.

The inputs take a gentle gate (log-decay in (-0.02, 0)) so the state carries across many chunks:
with K3's usual gate a chunk forgets its start almost entirely, and a wrong segment start state
would not show. Tolerances: a segment's start state enters its loop in fp32 where the unsegmented
kernel has carried it in registers, and ``A_j S_j + B_j`` is summed in a different order than the
chunks' bf16-operand products, so the two agree to bf16 rounding (2.7e-3 seen; bound 1e-2), while
starting the segments from zero is off by more than 5e-2 (asserted, so the bound can fail); with
two segments the first pass of segment 0 is the unsegmented loop itself, so o and the state agree
to fp32 summation order of the same kernel's products (1e-5).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.gpu_config import (
    MIN_SEGMENT_CHUNKS, chunk_config, default_inter, segments_for,
)
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda, gpu_chunk_kda_fused, intra_stage
from pallas_kernels.kda.mosaic_gpu.inter import inter_mgpu, states_mgpu
from pallas_kernels.kda.mosaic_gpu.segmented_inter import _as_segments, inter_segments
from pallas_kernels.kda.reference import chunked_kda
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

_BF16, _F32 = jnp.bfloat16, jnp.float32
B, T, H, K, V = 2, 4 * C, 2, 64, 128  # K != V: the transition columns are K wide
EXACT, BF16_ROUNDING, ZERO_STARTS_OFF = 1e-5, 1e-2, 5e-2


@pytest.fixture(scope="module")
def case():
    """Inputs, the intra stage's outputs and the unsegmented kernel's ``(o, state)``."""
    x = as_f32(kda_case(np.random.default_rng(0), B, T, H, K, V, lower_bound=-0.02))
    q, k, v, g = (x[n].astype(_BF16) for n in ("q", "k", "v", "g"))
    intra = intra_stage((q, k, v, g, x["beta"]), scale=K**-0.5, fused=False, lower_bound=-5.0,
                        interpret=True, params={}, inverse_params={}, pairs="mosaic_gpu",
                        with_wu=False)
    xx, bk, _, _, qg, kd, aqk, gl = intra
    stage = (xx, bk, v, x["beta"], qg, kd, aqk, gl)
    plain = inter_mgpu(*stage, x["s0"], fused=False, interpret=True)
    return dict(q=q, k=k, v=v, g=g, beta=x["beta"], s0=x["s0"], stage=stage, plain=plain)


def test_states_pass_gives_the_state_and_the_transition_matrix(case) -> None:
    """From ``[s0 | I]``: the first V columns are the unsegmented kernel's final state, the last
    K the transition matrix A with ``A s0 + B`` (B: the state from zero) that state again."""
    xx, bk, v, beta, _, kd, _, gl = case["stage"]
    s0, (_, s_end) = case["s0"], case["plain"]
    eye = jnp.broadcast_to(jnp.eye(K, dtype=_F32), (B, H, K, K))

    def run(start):
        return states_mgpu(xx, bk, v, beta, kd, gl, jnp.concatenate([start, eye], -1),
                           fused=False, interpret=True)

    ends, from_zero = run(s0), run(jnp.zeros_like(s0))
    assert ends.shape == (B, H, K, V + K) and ends.dtype == _F32
    assert rel(ends[..., :V], s_end) <= EXACT
    A = ends[..., V:]
    assert rel(A, from_zero[..., V:]) <= EXACT  # A does not depend on the start
    assert float(jnp.linalg.norm(A)) > 0.1  # the start matters at this gate
    affine = jnp.einsum("bhkj,bhjv->bhkv", A, s0, precision="highest") + from_zero[..., :V]
    assert rel(affine, s_end) <= BF16_ROUNDING


def test_segments_match_the_unsegmented_kernel(case) -> None:
    """Four segments of one chunk each: three start states formed by the combine."""
    stage, s0 = case["stage"], case["s0"]
    o_plain, s_plain = (t.astype(_F32) for t in case["plain"])
    o, s = inter_segments(*stage, s0, segments=4, fused=False, interpret=True)
    assert o.shape == (B, T, H, V) and o.dtype == _BF16 and s.shape == (B, H, K, V)
    assert rel(o.astype(_F32), o_plain) <= BF16_ROUNDING and rel(s, s_plain) <= BF16_ROUNDING
    # segments that started from zero instead are far off: the bound above can fail
    zero_starts = jnp.zeros((B * 4, H, K, V), _F32)
    o_zero, _ = inter_mgpu(*(_as_segments(t, 4) for t in stage), zero_starts, fused=False,
                           interpret=True)
    assert rel(o_zero.reshape(B, T, H, V).astype(_F32), o_plain) > ZERO_STARTS_OFF
    ref_o, ref_s = chunked_kda(*(case[n].astype(_F32) for n in ("q", "k", "v", "g")),
                               case["beta"], scale=K**-0.5, initial_state=s0)
    assert rel(o.astype(_F32), ref_o) <= 2e-2 and rel(s, ref_s) <= 2e-2  # the bf16 path's bound


def test_forward_with_two_segments_equals_the_fused_stage() -> None:
    """Through ``gpu_chunk_kda_fused``: T padded to whole segments with identity steps
    (gate and beta logits at -inf), the output cut back to T, and ``return_intra``'s (X, Aqk)
    cut to whole chunks, as the backward takes them."""
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), _F32)  # noqa: E731
    Tx = 2 * C + 5  # three chunks: padded to four for two segments
    q, k, g_raw = (f(1, Tx, H, K).astype(_BF16) for _ in range(3))
    v, b_logit = f(1, Tx, H, V).astype(_BF16), f(1, Tx, H).astype(_BF16)
    A_log, dt_bias, s0 = 0.3 * f(H), f(H * K) - 4.0, 0.1 * f(1, H, K, V)
    run = lambda inter: gpu_chunk_kda_fused(  # noqa: E731
        q, k, v, g_raw, b_logit, A_log, dt_bias, lower_bound=-5.0, initial_state=s0,
        config=chunk_config(q, k, v, g_raw, inter=inter))
    (o, s), (o_ref, s_ref) = run("segments"), run("fused")
    assert o.shape == (1, Tx, H, V) and s.shape == (1, H, K, V)
    assert rel(o.astype(_F32), o_ref.astype(_F32)) <= EXACT and rel(s, s_ref) <= EXACT
    x_ = as_f32(kda_case(np.random.default_rng(2), 1, Tx, H, K, V))
    ins = [x_[n].astype(_BF16) for n in ("q", "k", "v", "g")] + [x_["beta"]]
    run = lambda inter: gpu_chunk_kda(  # noqa: E731
        *ins, config=chunk_config(*ins[:4], inter=inter), return_intra=True)
    (_, _, (xx, aqk)), (_, _, (xx_ref, aqk_ref)) = run("segments"), run("fused")
    assert xx.shape == aqk.shape == (1, 3 * C, H, C)
    assert jnp.array_equal(xx, xx_ref) and jnp.array_equal(aqk, aqk_ref)


def test_segment_count_and_default() -> None:
    """Segments while (sequence-heads x segments) fit one wave and each keeps 16 chunks."""
    assert segments_for(16, 512) == 8  # K3's B1 T32768 H16: 128 CTA pairs
    assert segments_for(16, 100) == 4  # 4 segments of 25 chunks; 8 would have 12
    assert segments_for(16, 31) == 1
    assert segments_for(96, 512) == 1
    assert segments_for(1, 10**6) == 16  # at most MAX_SEGMENTS
    assert default_inter(16, 8)[0] == "segments" and default_inter(16, 1)[0] == "two_pass"
    assert default_inter(96, 8)[0] == "fused"


def test_naming_the_triton_inter_kernel_keeps_the_two_pass_default() -> None:
    """Few sequence-heads with ``inter_kernel="triton"``: no segments (they run on the Mosaic GPU
    kernels) but the two-pass stage, as before segments existed: the same arrays as asking for it."""
    assert segments_for(1, 2 * MIN_SEGMENT_CHUNKS) == 2  # by default these would be segmented
    x = as_f32(kda_case(np.random.default_rng(5), 1, 2 * MIN_SEGMENT_CHUNKS * C, 1, 64, 64))
    ins = [x[n].astype(_BF16) for n in ("q", "k", "v", "g")] + [x["beta"]]
    config = chunk_config(*ins[:4], inter_kernel="triton")
    assert config.inter == "two_pass"
    o, s = gpu_chunk_kda(*ins, config=config)
    o_ref, s_ref = gpu_chunk_kda(*ins, config=chunk_config(*ins[:4], inter="two_pass",
                                                            inter_kernel="triton"))
    assert jnp.array_equal(o, o_ref) and jnp.array_equal(s, s_ref)


def test_rejects_what_it_cannot_take() -> None:
    x = as_f32(kda_case(np.random.default_rng(3), 1, C, 1, 64, 64))
    q, k, v, g = (x[n].astype(_BF16) for n in ("q", "k", "v", "g"))
    needs = r"^inter='segments' runs the Mosaic GPU inter kernels: .*"
    with pytest.raises(ValueError, match=needs + "v float32"):
        chunk_config(q, k, v.astype(_F32), g, inter="segments")
    with pytest.raises(ValueError, match=needs + "cu_seqlens given"):
        chunk_config(q, k, v, g, inter="segments", cu_seqlens=np.array([0, 10, C], np.int32))
    with pytest.raises(ValueError, match=needs + "inter_kernel='triton'"):
        chunk_config(q, k, v, g, inter="segments", inter_kernel="triton")
    z = jnp.zeros((1, 3 * C, 1, C), _BF16)
    with pytest.raises(ValueError, match=r"^inter_segments: segments=2 must be at least 2 and "
                                         r"divide the 3 chunks"):
        inter_segments(z, z, z, jnp.zeros((1, 3 * C, 1)), z, z, z, jnp.zeros((1, 3, 1, C)),
                       jnp.zeros((1, 1, C, C)), segments=2, fused=False, interpret=True)


def test_lowers_for_h200() -> None:
    """Both passes (the states kernel and the inter kernel) lower to one Mosaic GPU custom call
    each, the combine to XLA products between them."""
    S = jax.ShapeDtypeStruct
    Bx, Tp, Hx, Kx = 1, 16 * C, 3, 128
    ins = [S((Bx, Tp, Hx, C), _BF16), S((Bx, Tp, Hx, Kx), _BF16), S((Bx, Tp, Hx, Kx), _BF16),
           S((Bx, Tp, Hx), _F32), S((Bx, Tp, Hx, Kx), _BF16), S((Bx, Tp, Hx, Kx), _BF16),
           S((Bx, Tp, Hx, C), _BF16), S((Bx, Tp // C, Hx, Kx), _F32), S((Bx, Hx, Kx, Kx), _F32)]
    text = lowered_for_h200(
        lambda *a: inter_segments(*a, segments=4, fused=True, interpret=False), *ins)
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 2
    assert "kda_states_mgpu" in text and "kda_inter_mgpu" in text
