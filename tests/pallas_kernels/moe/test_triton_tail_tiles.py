"""Two row-tile heights (TileConfig.tail_m) in the Triton grouped GEMMs, interpret mode on CPU.

An expert's last row tile runs at tail_m rows when it holds at most that many, instead of block_m. The
work table is unchanged (tiles never straddle experts; the remainder tile already starts at the expert's
last block_m boundary), so the checks are: the MMA-row accounting (`mma_rows`) per group pattern, and
numerics against `lax.ragged_dot` (fp32 out, rel <= 1e-5: same bf16 products, fp32 summation order only)
for remainders below, at and above tail_m, in both operand orientations, dense and MXFP4 weights.
With merge_tail the remainder instead joins the expert's last full tile (one program of block_m + tail_m
rows); the same checks apply, plus the table's row ranges themselves. Weights stored [E, K, N]
(`weights_kn`, the backward's products with the forward's weights) run through the same tile shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import triton as pg
from pallas_kernels.moe.reference import RAGGED_DIMS, situ
from pallas_kernels.mxfp4 import MXFP4Experts, encode_mxfp4
from tests.pallas_kernels.h200_lowering import lowered_for_h200

F32 = jnp.float32
M, K, N, E = 200, 64, 64, 5
CFG = pg.TileConfig(block_m=64, block_n=32, block_k=32, num_warps=4, num_stages=2, tail_m=16)
GROUPS = {
    "tails_below_at_above": [70, 16, 80, 17, 0],  # remainders 6, 16 (one short tile each), 16, 17 (full tile)
    "empty_first_last": [0, 100, 0, 100, 0],
    "all_one_expert": [0, 0, 200, 0, 0],  # 3 full tiles + a remainder of 8
    "tail_rows_zero": [10, 20, 0, 30, 33],  # rows 93.. past the groups come out zero
    "merged_cuts_both_ways": [150, 0, 0, 45, 5],  # merged: 150 = 80 + 70 (two 80-row programs), 45 and 5 alone
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ragged_f32(x, w, gs):
    return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DIMS, preferred_element_type=F32)


def operands():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, K), F32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(k[1], (E, N, K), F32) * K**-0.5 * 2).astype(jnp.bfloat16)
    w3 = (jax.random.normal(k[2], (E, N, K), F32) * K**-0.5).astype(jnp.bfloat16)
    return x, w1, w3


@pytest.mark.parametrize("sizes, tail_m, want, want_merged", [
    ([146] * 112, 32, 112 * (128 + 32), 112 * 160),  # K3 at EP=8: 146 rows per expert, one 160-row program
    ([147, 145] * 56, 32, 112 * (128 + 32), 112 * 160),
    ([585] * 28, 32, 28 * 5 * 128, 28 * (3 * 160 + 128)),  # remainder 73 > 32: a full tile unless merged
    ([585] * 28, 16, 28 * 5 * 128, 28 * (4 * 144 + 16)),
    ([146] * 112, None, 112 * 2 * 128, None),
    ([0, 128, 0, 256, 1], 32, 384 + 32, 384 + 32),  # 256 rows: two 128-row tiles beat 160 + 128
])
def test_mma_rows(sizes: list[int], tail_m: int | None, want: int, want_merged: int | None) -> None:
    cfg = pg.TileConfig(block_m=128, tail_m=tail_m)
    gs = jnp.asarray(sizes, jnp.int32)
    assert int(pg.mma_rows(gs, int(sum(sizes)) + 7, cfg)) == want
    if tail_m:
        merged = dataclasses.replace(cfg, weights_lhs=True, merge_tail=True)
        assert int(pg.mma_rows(gs, int(sum(sizes)) + 7, merged)) == want_merged


@pytest.mark.parametrize("sizes, want", [
    # 70 = 64 + 6 and 80 = 64 + 16 rows: one program each; 16 rows: a short tile; 17: a full one; the
    # 17 rows past the groups (183..199) form the virtual expert 5's tile
    (GROUPS["tails_below_at_above"], [[0, 70, 0], [70, 86, 1], [86, 166, 2], [166, 183, 3], [183, 200, 5]]),
    # 200 rows: 64 + 64 + (64 + 8 merged) costs 64 + 64 + 80 MMA rows, less than 80 + 80 + 40 (80 + 80 + 64)
    (GROUPS["all_one_expert"], [[0, 64, 2], [64, 128, 2], [128, 200, 2]]),
    # 150 rows: 80 + 70 costs 80 + 80, less than 64 + 64 + 22 (64 x 3); the other 50 rows are virtual
    (GROUPS["merged_cuts_both_ways"], [[0, 80, 0], [80, 150, 0], [150, 195, 3], [195, 200, 4]]),
])
def test_merged_schedule_row_ranges(sizes: list[int], want: list[list[int]]) -> None:
    """The merged table at block_m 64, tail 16: each expert cut the cheaper of two ways (_row_tiling)."""
    table = np.asarray(pg.schedule(jnp.asarray(sizes, jnp.int32), M, 64, 1, merge_rows=16))
    active = table[table[:, 0] < table[:, 1]]
    assert active[:, :3].tolist() == want


@pytest.mark.parametrize("weights_lhs, merge_tail", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("name", list(GROUPS))
def test_tail_tiles_match_ragged_dot(name: str, weights_lhs: bool, merge_tail: bool) -> None:
    x, w1, w3 = operands()
    gs = jnp.asarray(GROUPS[name], jnp.int32)
    cfg = dataclasses.replace(CFG, weights_lhs=weights_lhs, merge_tail=merge_tail)
    gate_up = pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(gate_up, situ(ragged_f32(x, w1, gs), ragged_f32(x, w3, gs), 4.0, 25.0)) <= 1e-5
    plain = pg.grouped_matmul(x, w1, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(plain, ragged_f32(x, w1, gs)) <= 1e-5
    for out in (gate_up, plain):
        np.testing.assert_array_equal(np.asarray(out[int(gs.sum()):]), 0.0)


@pytest.mark.parametrize("merge_tail", [False, True])
def test_tail_tiles_with_mxfp4_weights(merge_tail: bool) -> None:
    x, _, _ = operands()
    packed = MXFP4Experts(*map(jnp.asarray, encode_mxfp4(np.random.default_rng(1).standard_normal((E, N, K)) / 8)))
    gs = jnp.asarray(GROUPS["tails_below_at_above"], jnp.int32)
    cfg = dataclasses.replace(CFG, weights_lhs=True, merge_tail=merge_tail)
    out = pg.grouped_matmul(x, packed, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(out, ragged_f32(x, packed.decode(jnp.bfloat16), gs)) <= 1e-5


def test_rejects_bad_tail_height() -> None:
    x, w1, _ = operands()
    gs = jnp.asarray(GROUPS["empty_first_last"], jnp.int32)
    for tail_m in (64, 24, 8):
        with pytest.raises(ValueError, match=f"tail_m={tail_m}"):
            pg.grouped_matmul(x, w1, gs, cfg=dataclasses.replace(CFG, tail_m=tail_m), interpret=True)
    for bad in (dataclasses.replace(CFG, merge_tail=True), dataclasses.replace(CFG, tail_m=None, merge_tail=True,
                                                                                  weights_lhs=True)):
        with pytest.raises(ValueError, match="merge_tail needs tail_m and weights_lhs"):
            pg.grouped_matmul(x, w1, gs, cfg=bad, interpret=True)


def test_merged_tail_pads_tiny_inputs() -> None:
    """Fewer rows than block_m + tail_m: x is padded so the merged tile's load stays in bounds."""
    x, w1, _ = operands()
    x = x[:72]
    gs = jnp.asarray([0, 72, 0, 0, 0], jnp.int32)  # one 64-row tile + an 8-row remainder, merged
    cfg = dataclasses.replace(CFG, weights_lhs=True, merge_tail=True)
    out = pg.grouped_matmul(x, w1, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert out.shape == (72, N) and rel(out, ragged_f32(x, w1, gs)) <= 1e-5


def test_tail_tiles_lower_to_triton_for_cuda() -> None:
    """K3 at EP=8 (112 experts) with 128 + 32-row tiles, as the H200 would compile it (no GPU needed)."""
    sds = jax.ShapeDtypeStruct
    w = sds((112, 3072, 3584), jnp.bfloat16)
    args = (sds((16384, 3584), jnp.bfloat16), w, w, sds((112,), jnp.int32))
    for merge_tail in (False, True):
        cfg = pg.TileConfig(128, 128, 64, 8, 4, weights_lhs=True, tail_m=32, merge_tail=merge_tail)
        fn = lambda *a: pg.grouped_gate_up_situ(*a, cfg=cfg)  # noqa: E731
        assert "__gpu$xla.gpu.triton" in lowered_for_h200(fn, *args)


def test_default_configs_by_group_size_and_weight_format() -> None:
    """Tiles picked from static shapes: small groups (< 320 rows/expert) get the merged tail tile; MXFP4
    weights the left-operand order, and at 28 experts gate+up one warpgroup per program; the 28-expert bf16
    defaults are the measured ones, unchanged."""
    assert pg.gate_up_config(16384, 28) == pg.GATE_UP_DEFAULT and pg.down_config(16384, 28) == pg.DOWN_DEFAULT
    for cfg in (pg.gate_up_config(16384, 112), pg.down_config(16384, 112)):
        assert cfg.tail_m == 32 and cfg.merge_tail
    for cfg in (pg.gate_up_config(16384, 28, mxfp4=True), pg.down_config(16384, 112, mxfp4=True)):
        assert cfg.weights_lhs
    assert pg.gate_up_config(16384, 28, mxfp4=True) == pg.GATE_UP_MXFP4  # one warpgroup per program


@pytest.mark.parametrize("weights_lhs, merge_tail", [(False, False), (True, False), (True, True)])
def test_weights_stored_k_by_n(weights_lhs: bool, merge_tail: bool) -> None:
    """weights_kn: w [E, K, N] gives x @ w_e, as the [E, N, K] layout does with the transposed weights
    (fp32 out, rel <= 1e-6: the same products, summed in another order when the weights are the MMA's lhs)."""
    x, w1, _ = operands()
    gs = jnp.asarray(GROUPS["merged_cuts_both_ways"], jnp.int32)
    cfg = dataclasses.replace(CFG, weights_lhs=weights_lhs, merge_tail=merge_tail)
    w_kn = jnp.swapaxes(w1, 1, 2)  # [E, K, N]
    got = pg.grouped_matmul(x, w_kn, gs, cfg=cfg, out_dtype=F32, interpret=True, weights_kn=True)
    want = pg.grouped_matmul(x, w1, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert got.shape == (M, N) and rel(got, want) <= 1e-6
    assert rel(got, ragged_f32(x, w1, gs)) <= 1e-5


def test_weights_kn_rejects_bad_layouts() -> None:
    x, w1, _ = operands()
    gs = jnp.asarray(GROUPS["empty_first_last"], jnp.int32)
    with pytest.raises(ValueError, match=r"w1 must be \[E, 64, N\]"):
        pg.grouped_matmul(x, jnp.zeros((E, K + 32, N), jnp.bfloat16), gs, cfg=CFG, interpret=True, weights_kn=True)
    packed = MXFP4Experts(*map(jnp.asarray, encode_mxfp4(np.ones((E, N, K), np.float32))))
    with pytest.raises(ValueError, match="weights_kn=True takes dense weights"):
        pg.grouped_matmul(x, packed, gs, cfg=CFG, interpret=True, weights_kn=True)
