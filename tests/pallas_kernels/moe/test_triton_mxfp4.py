"""MXFP4 weights decoded inside the Triton grouped GEMMs (interpret mode on CPU) vs decode-then-reference.

Ground truth for the decode is `pallas_kernels.mxfp4.decode_mxfp4_jax`; for the GEMMs, `lax.ragged_dot` on
the decoded weights. Tolerances: the in-kernel decode is exact (compared bit for bit), and a bf16 x bf16
product is exact in fp32, so the kernels differ from the reference only in the fp32 summation order of the
K loop (a few fp32 ulps, ~1e-7 relative; SiTU adds a few more): rel <= 1e-5 leaves two orders of margin
while a wrong nibble order, scale block or sign gives O(1) errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import experts_ragged_dot, routed_experts
from pallas_kernels.moe import triton as pg
from pallas_kernels.moe.reference import RAGGED_DIMS, situ
from pallas_kernels.mxfp4 import MXFP4Experts, decode_mxfp4_jax, decode_tile, encode_mxfp4
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.moe.routed import pallas_gpu_experts

F32 = jnp.float32
M, E = 200, 5
CFG = pg.TileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
GROUPS = {
    "uneven": [37, 0, 81, 45, 37],
    "empty_first_last": [0, 100, 0, 100, 0],
    "all_one_expert": [0, 0, 200, 0, 0],
    "tail_rows_zero": [10, 20, 0, 30, 33],  # sum 93 < M: rows 93.. must be zeros (as lax.ragged_dot)
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def packed_experts(rng, shape, std: float) -> MXFP4Experts:
    return MXFP4Experts(*map(jnp.asarray, encode_mxfp4(rng.standard_normal(shape) * std)))


def ragged_f32(x, w, gs):
    return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DIMS, preferred_element_type=F32)


@functools.lru_cache(maxsize=None)
def operands(n: int = 64, k: int = 96):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, k)) * 2, jnp.bfloat16)
    w1 = packed_experts(rng, (E, n, k), 2 / np.sqrt(k))  # gates reach the SiTU cap
    w3 = packed_experts(rng, (E, n, k), 1 / np.sqrt(k))
    return x, w1, w3


def test_decode_tile_matches_release_decode_bit_for_bit() -> None:
    """Every byte (two codes) under every scale byte 1..252, plus the all-zero block's scale byte 0."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (253, 1)).reshape(253 * 8, 32)  # 64 columns a row
    scale = np.repeat(np.arange(253, dtype=np.uint8), 8)[:, None].repeat(2, 1)
    packed[scale[:, 0] == 0] = 0  # byte 0 only ever scales an all-zero block
    got = jax.jit(decode_tile, static_argnums=2)(packed, scale, F32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(decode_mxfp4_jax(packed, scale, F32)))
    bf16 = decode_tile(jnp.asarray(packed[:64]), jnp.asarray(scale[:64]))
    assert bf16.dtype == jnp.bfloat16


@pytest.mark.parametrize("weights_lhs", [False, True])
@pytest.mark.parametrize("name", list(GROUPS))
def test_grouped_gemms_match_decode_then_ragged_dot(name: str, weights_lhs: bool) -> None:
    x, w1, w3 = operands()
    gs = jnp.asarray(GROUPS[name], jnp.int32)
    d1, d3 = w1.decode(jnp.bfloat16), w3.decode(jnp.bfloat16)
    cfg = dataclasses.replace(CFG, weights_lhs=weights_lhs)
    gate_up = pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(gate_up, situ(ragged_f32(x, d1, gs), ragged_f32(x, d3, gs), 4.0, 25.0)) <= 1e-5
    plain = pg.grouped_matmul(x, w1, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(plain, ragged_f32(x, d1, gs)) <= 1e-5
    tail = int(gs.sum())
    for out in (gate_up, plain):
        np.testing.assert_array_equal(np.asarray(out[tail:]), 0.0)


def test_weights_lhs_dense_matches_ragged_dot() -> None:
    """The transposed-accumulator order on bf16 weights, 16-row tiles (the MMA's N), rows past the groups."""
    x, w1, w3 = operands()
    d1, d3 = w1.decode(jnp.bfloat16), w3.decode(jnp.bfloat16)
    gs = jnp.asarray(GROUPS["tail_rows_zero"], jnp.int32)
    cfg = pg.TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, weights_lhs=True)
    out = pg.grouped_gate_up_situ(x, d1, d3, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(out, situ(ragged_f32(x, d1, gs), ragged_f32(x, d3, gs), 4.0, 25.0)) <= 1e-5
    np.testing.assert_array_equal(np.asarray(out[int(gs.sum()):]), 0.0)


def test_wide_k_tile_and_default_tiles() -> None:
    """block_k = 64 (two scale bytes a tile) and the GPU defaults, bf16 out (error: the bf16 rounding)."""
    x, w1, w3 = operands(n=128, k=128)
    gs = jnp.asarray([70, 0, 33, 50, 47], jnp.int32)
    d1, d3 = w1.decode(jnp.bfloat16), w3.decode(jnp.bfloat16)
    ref = situ(ragged_f32(x, d1, gs), ragged_f32(x, d3, gs), 4.0, 25.0)
    cfg64 = pg.TileConfig(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=2)
    assert rel(pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=cfg64, out_dtype=F32, interpret=True), ref) <= 1e-5
    out = pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=pg.GATE_UP_DEFAULT, interpret=True)
    assert out.dtype == jnp.bfloat16 and rel(out, ref) < 4e-3


def test_rejects_bad_packed_weights() -> None:
    x, w1, w3 = operands()
    gs = jnp.asarray(GROUPS["uneven"], jnp.int32)
    with pytest.raises(ValueError, match="block_k=16"):
        pg.grouped_matmul(x, w1, gs, cfg=pg.TileConfig(32, 32, 16, 4, 2), interpret=True)
    with pytest.raises(ValueError, match="K=96"):  # K not a multiple of the tile: callers fit block_k first
        pg.grouped_matmul(x, w1, gs, cfg=pg.TileConfig(32, 32, 64, 4, 2), interpret=True)
    with pytest.raises(ValueError, match="w3"):
        pg.grouped_gate_up_situ(x, w1, w3.decode(jnp.bfloat16), gs, cfg=CFG, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        pg.grouped_matmul(x, MXFP4Experts(w1.packed, w1.scale[:, :, :1]), gs, cfg=CFG, interpret=True)


# ---- whole routed-expert path ---------------------------------------------------------------------


def expert_case(n_tok: int, k: int, d_in: int, f: int, d_out: int, ids=None, seed: int = 3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n_tok, d_in)) * 2, F32)
    w1 = packed_experts(rng, (8, f, d_in), 1.5 / np.sqrt(d_in))
    w3 = packed_experts(rng, (8, f, d_in), 1 / np.sqrt(d_in))
    w2 = packed_experts(rng, (8, d_out, f), 1 / np.sqrt(f))
    if ids is None:
        ids = np.stack([rng.choice(8, k, replace=False) for _ in range(n_tok)])
    weights = jnp.asarray(rng.uniform(0.05, 1.0, ids.shape), F32)
    return x, w1, w2, w3, weights, jnp.asarray(ids, jnp.int32)


CASES = {
    # in = 96: the default block_k of 64 does not divide it and is fitted down to 32; out = 40 is padded
    "k_not_tile_multiple": dict(n_tok=37, k=3, d_in=96, f=64, d_out=40),
    # every token on experts 5, 1, 6: three groups hold all rows, the first, last and others are empty
    "all_same": dict(n_tok=9, k=3, d_in=64, f=64, d_out=32, ids=np.tile([5, 1, 6], (9, 1))),
    # 300 rows over 8 experts: past decode size, so the layer is decoded before the bf16 kernels
    "many_rows_per_expert": dict(n_tok=300, k=1, d_in=64, f=64, d_out=32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_routed_experts_packed_pallas_matches_decoded_xla(name: str) -> None:
    x, w1, w2, w3, weights, ids = expert_case(**CASES[name])
    run = lambda impl: jax.jit(functools.partial(  # noqa: E731
        routed_experts, beta=4.0, linear_beta=25.0, implementation=impl))(x, w1, w2, w3, weights, ids)
    out, ref = run("pallas_gpu"), run("xla")
    assert out.shape == ref.shape and out.dtype == F32
    assert rel(out, ref) <= 1e-5  # fp32 x and exact decodes on both sides: summation order only


@pytest.mark.parametrize(("name", "packed_in_kernel"), [("k_not_tile_multiple", True), ("many_rows_per_expert", False)])
def test_pallas_keeps_weights_packed_only_for_decode_sized_batches(name: str, packed_in_kernel: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """111 routed rows over 8 experts (decode-sized) reach the kernels packed; 300 rows are decoded first."""
    decoded = []
    real_decode = MXFP4Experts.decode
    monkeypatch.setattr(MXFP4Experts, "decode", lambda w, dtype: decoded.append(w) or real_decode(w, dtype))
    x, w1, w2, w3, weights, ids = expert_case(**CASES[name])
    routed_experts(x, w1, w2, w3, weights, ids, beta=4.0, linear_beta=25.0, implementation="pallas_gpu")
    assert len(decoded) == (0 if packed_in_kernel else 3)


def test_default_tiles_for_decode_sized_batches() -> None:
    """Up to 32 rows per expert: one 32-row tile, 64 weight rows and one warpgroup per program, forward only;
    with MXFP4 weights also a 16-row tile."""
    for cfg in (pg.gate_up_config(256, 28), pg.down_config(256, 28)):
        assert cfg == pg.DECODE_TILES
    for cfg in (pg.gate_up_config(896, 28, mxfp4=True), pg.down_config(256, 28, mxfp4=True)):
        assert cfg == pg.DECODE_TILES_MXFP4 and cfg.tail_m == 16
    assert pg.gate_up_config(897, 28) != pg.DECODE_TILES
    assert pg.down_config(256, 28, backward=True) == pg.DOWN_SMALL_GROUPS


def test_packed_grads_flow_to_x_only() -> None:
    """jax.grad through packed experts: dx and d(routing weights) as XLA autodiff on the decoded weights."""
    x, w1, w2, w3, weights, ids = expert_case(**CASES["k_not_tile_multiple"])
    cot = jax.random.normal(jax.random.key(1), (x.shape[0], w2.shape[1]), F32)
    small = pg.TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)  # fitted to 32 for packed
    pallas = functools.partial(pallas_gpu_experts, w1=w1, w2=w2, w3=w3, beta=4.0, linear_beta=25.0,
                               gate_up_cfg=small, down_cfg=small, bwd_cfg=small)
    dense = [w.decode(F32) for w in (w1, w2, w3)]
    xla = lambda x_, r_, ids_: experts_ragged_dot(x_, *dense, r_, ids_, beta=4.0, linear_beta=25.0)  # noqa: E731
    grad = lambda fn: jax.jit(jax.grad(  # noqa: E731
        lambda x_, r_: jnp.sum(fn(x_, weights=r_, ids=ids) * cot), argnums=(0, 1)))(x, weights)
    got = grad(lambda x_, weights, ids: pallas(x_, weights=weights, ids=ids))
    want = grad(lambda x_, weights, ids: xla(x_, weights, ids))
    for g, w in zip(got, want):
        assert rel(g, w) <= 1e-5


@pytest.mark.parametrize("weights_lhs", [False, True])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_packed_kernels_lower_to_triton_for_cuda(which: str, weights_lhs: bool) -> None:
    """Pallas -> Triton IR at the K3 shapes (28 experts) with packed weights, as the H200 would compile it."""
    m, h, f, experts = 16384, 3584, 3072, 28
    sds = jax.ShapeDtypeStruct
    packed = lambda n, k: MXFP4Experts(sds((experts, n, k // 2), jnp.uint8),  # noqa: E731
                                       sds((experts, n, k // 32), jnp.uint8))
    gs = sds((experts,), jnp.int32)
    cfg = pg.TileConfig(128, 128, 64, 8, 4, weights_lhs=weights_lhs)
    if which == "down":
        fn, args = functools.partial(pg.grouped_matmul, cfg=cfg), (sds((m, f), jnp.bfloat16), packed(h, f), gs)
    else:
        fn = functools.partial(pg.grouped_gate_up_situ, cfg=cfg)
        args = (sds((m, h), jnp.bfloat16), packed(f, h), packed(f, h), gs)
    text = lowered_for_h200(fn, *args)
    assert "__gpu$xla.gpu.triton" in text
    # The Triton IR was also compiled to sm_90 SASS with Triton 3.6 off-GPU while tuning (wgmma, no spills
    # beyond a few bytes); that needs the triton package, which this environment does not install.


@pytest.mark.parametrize("tokens", [2048, 32])
def test_routed_path_lowers_for_cuda_with_packed_experts(tokens: int) -> None:
    """routed_experts on packed K3 experts (E=28, top-8) as the H200 would compile it. 2048 tokens (585
    rows per expert): gate+up in the Mosaic GPU kernel that decodes the packed gate and up weights in
    registers (no decoded copy of them), the down projection on the decoded w2 in Mosaic GPU. 32 tokens
    (decode-sized): both products in the Triton kernels' tile decode, no decoded copy of any weight."""
    sds = jax.ShapeDtypeStruct
    packed = lambda n, k: MXFP4Experts(sds((28, n, k // 2), jnp.uint8), sds((28, n, k // 32), jnp.uint8))  # noqa: E731
    args = (sds((tokens, 3584), jnp.bfloat16), packed(3072, 3584), packed(3584, 3072), packed(3072, 3584),
            sds((tokens, 8), F32), sds((tokens, 8), jnp.int32))
    fn = functools.partial(routed_experts, beta=4.0, linear_beta=25.0, implementation="pallas_gpu")
    text = lowered_for_h200(fn, *args)
    assert "28x3072x3584xbf16" not in text  # gate and up stay packed
    if tokens == 2048:
        assert "k3_moe_gate_up_situ_mxfp4_mgpu" in text and "k3_moe_grouped_matmul_mgpu" in text
        assert "__gpu$xla.gpu.triton" not in text
    else:
        assert text.count("__gpu$xla.gpu.triton") == 2 and "mosaic_gpu_v2(" not in text
        assert "k3_moe_gate_up_situ_mxfp4" in text and "k3_moe_grouped_matmul_mxfp4" in text
        assert "28x3584x3072xbf16" not in text  # w2 stays packed too
