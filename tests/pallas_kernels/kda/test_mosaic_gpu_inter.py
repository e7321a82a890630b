"""The Mosaic GPU inter kernel (``mosaic_gpu/inter.py``) in Mosaic GPU's CPU interpreter against the
Triton inter kernel forming W and U in its loop, and lowered for an abstract H200.

Tolerance: both kernels round the same operands to bf16 (S, beta v - bk S, v_new) and accumulate
in fp32, so they agree up to fp32 summation order. Where that order differs, a value can land on
the other side of a bf16 rounding boundary and the element moves by one bf16 step (2^-8 to 2^-7
relative). The order is the host's: XLA:CPU blocks the interpreter's dots by core count and vector
width, and a two-core host flipped a few elements of o (3-4e-5 relative L2; one flip in every
element would be ~4e-3). 1e-3 allows flips in a few percent of the elements while a wrong tile,
slot, transpose or decay is off by O(1).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.chunk_math import C
from pallas_kernels.kda.gpu_config import ChunkProblem, GpuChunkConfig, chunk_config
from pallas_kernels.kda.gpu_pipeline import gpu_chunk_kda, gpu_chunk_kda_fused, intra_stage
from pallas_kernels.kda.mosaic_gpu.inter import inter_mgpu
from pallas_kernels.kda.reference import chunked_kda
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.kda.kda_cases import as_f32, kda_case, rel

_BF16, _F32 = jnp.bfloat16, jnp.float32
TOL = 1e-3


def _bf16_case(seed: int, T: int, H: int, K: int, V: int):
    x = as_f32(kda_case(np.random.default_rng(seed), 1, T, H, K, V))
    q, k, v, g = (x[n].astype(_BF16) for n in ("q", "k", "v", "g"))
    return q, k, v, g, x["beta"], x["s0"]


def test_two_warpgroups_share_the_chunk_tiles() -> None:
    """K = V = 128: two warpgroups per CTA, warpgroup 0 issuing the copies, over three chunks
    (both slots reused). Called eagerly: under an outer jit the interpreter's warpgroup threads
    can starve a two-core host, so there the kernel takes one warpgroup by default."""
    q, k, v, g, beta, s0 = _bf16_case(1, 3 * C, 2, 128, 128)
    x, bk, _, _, qg, kd, aqk, gl = intra_stage(
        (q, k, v, g, beta), scale=128**-0.5, fused=False, lower_bound=-5.0, interpret=True,
        params={}, inverse_params={}, pairs="mosaic_gpu", with_wu=False)
    o, s = inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, s0, fused=False, interpret=True,
                      warpgroups=2)
    o_tri, s_tri = gpu_chunk_kda(q, k, v, g, beta, initial_state=s0,
                                 config=chunk_config(q, k, v, g, inter="fused",
                                                     inter_kernel="triton"))
    assert o.dtype == _BF16 and s.dtype == _F32 and s.shape == s0.shape
    assert rel(o.astype(_F32), o_tri.astype(_F32)) <= TOL and rel(s, s_tri) <= TOL
    # and against the fp32 reference, within the bf16 path's bound (2e-2, as the Triton path's
    # bf16 tests: every intermediate rounded to bf16)
    ref_o, ref_s = chunked_kda(q.astype(_F32), k.astype(_F32), v.astype(_F32), g.astype(_F32),
                               beta, scale=128**-0.5, initial_state=s0)
    assert rel(o.astype(_F32), ref_o) <= 2e-2 and rel(s, ref_s) <= 2e-2


# T = 1: one chunk, fewer than the slots; T = 65: a padded second chunk; K != V both ways
@pytest.mark.parametrize("T, K, V", [(1, 128, 128), (2 * C + 1, 64, 128), (C + 1, 128, 64)],
                         ids=["one chunk", "K64 V128", "K128 V64"])
def test_forward_matches_the_triton_inter_kernel(T: int, K: int, V: int) -> None:
    """Through ``gpu_chunk_kda_fused`` (beta logits: the sigmoid in the loop)."""
    rng = np.random.default_rng(2)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), _F32)  # noqa: E731
    H = 2
    q, k, g_raw = (f(1, T, H, K).astype(_BF16) for _ in range(3))
    v = f(1, T, H, V).astype(_BF16)
    b_logit = f(1, T, H).astype(_BF16)
    A_log, dt_bias, s0 = 0.3 * f(H), 0.5 * f(H * K), 0.1 * f(1, H, K, V)
    run = lambda ik: gpu_chunk_kda_fused(  # noqa: E731
        q, k, v, g_raw, b_logit, A_log, dt_bias, lower_bound=-5.0, initial_state=s0,
        config=chunk_config(q, k, v, g_raw, inter="fused", inter_kernel=ik))
    (o, s), (o_tri, s_tri) = run("mosaic_gpu"), run("triton")
    assert o.shape == (1, T, H, V) and s.shape == (1, H, K, V)
    assert rel(o.astype(_F32), o_tri.astype(_F32)) <= TOL and rel(s, s_tri) <= TOL


def test_default_takes_it_where_it_fits() -> None:
    def inter_kernel(inter: str, K: int, V: int, dtype, varlen: bool) -> str:
        problem = ChunkProblem(K=K, V=V, q_dtype=_BF16, k_dtype=_BF16, v_dtype=dtype,
                               g_dtype=_F32, sequence_heads=64, n_chunks=4, varlen=varlen)
        return GpuChunkConfig.for_problem(problem, inter=inter).inter_kernel

    assert inter_kernel("fused", 128, 128, _BF16, False) == "mosaic_gpu"
    assert inter_kernel("fused", 128, 128, _F32, False) == "triton"
    assert inter_kernel("fused", 128, 128, _BF16, True) == "triton"
    assert inter_kernel("fused", 256, 128, _BF16, False) == "triton"
    assert inter_kernel("two_pass", 128, 128, _BF16, False) == "triton"


@pytest.mark.parametrize("fused, K, V", [(False, 128, 128), (True, 128, 128), (False, 64, 64)])
def test_lowers_for_h200(fused: bool, K: int, V: int) -> None:
    """Pallas -> Mosaic GPU lowering (layout inference included) for an H200: one Mosaic GPU
    custom call carrying the kernel's name."""
    S = jax.ShapeDtypeStruct
    B, Tp, H = 2, 4 * C, 3
    ins = [S((B, Tp, H, C), _BF16), S((B, Tp, H, K), _BF16), S((B, Tp, H, V), _BF16),
           S((B, Tp, H), _F32), S((B, Tp, H, K), _BF16), S((B, Tp, H, K), _BF16),
           S((B, Tp, H, C), _BF16), S((B, Tp // C, H, K), _F32), S((B, H, K, V), _F32)]
    text = lowered_for_h200(lambda *a: inter_mgpu(*a, fused=fused, interpret=False), *ins)
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 1
    assert "kda_inter_mgpu" in text


def test_rejects_what_it_cannot_take() -> None:
    q, k, v, g, beta, s0 = _bf16_case(3, C, 1, 64, 64)
    with pytest.raises(ValueError, match=r"^inter_kernel='mosaic_gpu' needs the fused or "
                                         r"segmented inter stage, .* v float32"):
        chunk_config(q, k, v.astype(_F32), g, inter="fused", inter_kernel="mosaic_gpu")
    with pytest.raises(ValueError, match=r"inter='two_pass'"):
        chunk_config(q, k, v, g, inter="two_pass", inter_kernel="mosaic_gpu")
    with pytest.raises(ValueError, match=r"cu_seqlens given"):
        chunk_config(q, k, v, g, inter="fused", cu_seqlens=np.array([0, 10, C], np.int32),
                     inter_kernel="mosaic_gpu")
    with pytest.raises(ValueError, match=r"^inter_kernel: expected one of \('triton', "):
        chunk_config(q, k, v, g, inter_kernel="cuda")
    # a config made for another problem is checked against this one
    config = chunk_config(q, k, v, g, inter="fused")
    assert config.inter_kernel == "mosaic_gpu"
    with pytest.raises(ValueError, match=r"^pairs='mosaic_gpu' needs bf16 q, k, v"):
        gpu_chunk_kda(q, k, v.astype(_F32), g, beta, config=config)
    x = jnp.zeros((1, C, 1, C), _BF16)
    with pytest.raises(ValueError, match=r"^mosaic_gpu_inter: warpgroups=2 of 64 value columns "
                                         r"must cover"):
        inter_mgpu(x, x, x, jnp.zeros((1, C, 1)), x, x, x, jnp.zeros((1, 1, 1, C)),
                   jnp.zeros((1, 1, C, C)), fused=False, interpret=True, warpgroups=2)


def test_32_value_columns_per_warpgroup_match_64() -> None:
    """``value_cols=32`` (twice the CTAs per head, [*, 32] operands in a 64-byte swizzle) against
    the default 64 columns: the same products per column, so the same outputs to fp32 summation
    order and its bf16 flips (``TOL``), over two chunks."""
    q, k, v, g, beta, s0 = _bf16_case(4, 2 * C, 2, 64, 128)
    x, bk, _, _, qg, kd, aqk, gl = intra_stage(
        (q, k, v, g, beta), scale=64**-0.5, fused=False, lower_bound=-5.0, interpret=True,
        params={}, inverse_params={}, pairs="mosaic_gpu", with_wu=False)
    run = lambda cols: inter_mgpu(x, bk, v, beta, qg, kd, aqk, gl, s0, fused=False,  # noqa: E731
                                  interpret=True, value_cols=cols)
    (o32, s32), (o64, s64) = run(32), run(64)
    assert rel(o32.astype(_F32), o64.astype(_F32)) <= TOL and rel(s32, s64) <= TOL
