"""Two row-tile heights (TileConfig.tail_m) in the Pallas grouped GEMMs, interpret mode on CPU.

An expert's last row tile runs at tail_m rows when it holds at most that many, instead of block_m. The
work table is unchanged (tiles never straddle experts; the remainder tile already starts at the expert's
last block_m boundary), so the checks are: the MMA-row accounting (`mma_rows`) per group pattern, and
numerics against `lax.ragged_dot` (fp32 out, rel <= 1e-5: same bf16 products, fp32 summation order only)
for remainders below, at and above tail_m, in both operand orientations, dense and MXFP4 weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.checkpoint.mxfp4 import encode_mxfp4
from pallas_kernels.moe import MXFP4Experts
from pallas_kernels.moe import pallas_grouped_gemm as pg
from pallas_kernels.moe.reference import _RAGGED_DIMS, situ

F32 = jnp.float32
M, K, N, E = 200, 64, 64, 5
CFG = pg.TileConfig(block_m=64, block_n=32, block_k=32, num_warps=4, num_stages=2, tail_m=16)
GROUPS = {
    "tails_below_at_above": [70, 16, 80, 17, 0],  # remainders 6, 16 (one short tile each), 16, 17 (full tile)
    "empty_first_last": [0, 100, 0, 100, 0],
    "all_one_expert": [0, 0, 200, 0, 0],  # 3 full tiles + a remainder of 8
    "tail_rows_zero": [10, 20, 0, 30, 33],  # rows 93.. past the groups come out zero
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ragged_f32(x, w, gs):
    return jax.lax.ragged_dot_general(x, w, gs, _RAGGED_DIMS, preferred_element_type=F32)


def operands():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, K), F32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(k[1], (E, N, K), F32) * K**-0.5 * 2).astype(jnp.bfloat16)
    w3 = (jax.random.normal(k[2], (E, N, K), F32) * K**-0.5).astype(jnp.bfloat16)
    return x, w1, w3


@pytest.mark.parametrize("sizes, tail_m, want", [
    ([146] * 112, 32, 112 * (128 + 32)),  # K3 at EP=8: 146 rows per expert
    ([147, 145] * 56, 32, 112 * (128 + 32)),
    ([585] * 28, 32, 28 * 5 * 128),  # remainder 73 > 32: a full tile, as without tail_m
    ([146] * 112, None, 112 * 2 * 128),
    ([0, 128, 0, 256, 1], 32, 384 + 32),
])
def test_mma_rows(sizes: list[int], tail_m: int | None, want: int) -> None:
    cfg = pg.TileConfig(block_m=128, tail_m=tail_m)
    gs = jnp.asarray(sizes, jnp.int32)
    assert int(pg.mma_rows(gs, int(sum(sizes)) + 7, cfg)) == want


@pytest.mark.parametrize("weights_lhs", [False, True])
@pytest.mark.parametrize("name", list(GROUPS))
def test_tail_tiles_match_ragged_dot(name: str, weights_lhs: bool) -> None:
    x, w1, w3 = operands()
    gs = jnp.asarray(GROUPS[name], jnp.int32)
    cfg = dataclasses.replace(CFG, weights_lhs=weights_lhs)
    gate_up = pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(gate_up, situ(ragged_f32(x, w1, gs), ragged_f32(x, w3, gs), 4.0, 25.0)) <= 1e-5
    plain = pg.grouped_matmul(x, w1, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(plain, ragged_f32(x, w1, gs)) <= 1e-5
    for out in (gate_up, plain):
        np.testing.assert_array_equal(np.asarray(out[int(gs.sum()):]), 0.0)


def test_tail_tiles_with_mxfp4_weights() -> None:
    x, _, _ = operands()
    packed = MXFP4Experts(*map(jnp.asarray, encode_mxfp4(np.random.default_rng(1).standard_normal((E, N, K)) / 8)))
    gs = jnp.asarray(GROUPS["tails_below_at_above"], jnp.int32)
    cfg = dataclasses.replace(CFG, weights_lhs=True)
    out = pg.grouped_matmul(x, packed, gs, cfg=cfg, out_dtype=F32, interpret=True)
    assert rel(out, ragged_f32(x, packed.decode(jnp.bfloat16), gs)) <= 1e-5


def test_rejects_bad_tail_height() -> None:
    x, w1, _ = operands()
    gs = jnp.asarray(GROUPS["empty_first_last"], jnp.int32)
    for tail_m in (64, 24, 8):
        with pytest.raises(ValueError, match=f"tail_m={tail_m}"):
            pg.grouped_matmul(x, w1, gs, cfg=dataclasses.replace(CFG, tail_m=tail_m), interpret=True)


def test_tail_tiles_lower_to_triton_for_cuda(h200_triton: None) -> None:
    """K3 at EP=8 (112 experts) with 128 + 32-row tiles, as the H200 would compile it (no GPU needed)."""
    sds = jax.ShapeDtypeStruct
    w = sds((112, 3072, 3584), jnp.bfloat16)
    args = (sds((16384, 3584), jnp.bfloat16), w, w, sds((112,), jnp.int32))
    cfg = pg.TileConfig(128, 128, 64, 8, 4, weights_lhs=True, tail_m=32)
    fn = lambda *a: pg.grouped_gate_up_situ(*a, cfg=cfg)  # noqa: E731
    assert "__gpu$xla.gpu.triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_default_configs_by_group_size_and_weight_format() -> None:
    """Tiles picked from static shapes: small groups (< 320 rows/expert) get the tail tile; MXFP4 weights the
    left-operand order; the 28-expert bf16 defaults are the
    measured ones, unchanged."""
    assert pg.gate_up_config(16384, 28) == pg.GATE_UP_DEFAULT and pg.down_config(16384, 28) == pg.DOWN_DEFAULT
    assert pg.gate_up_config(16384, 112).tail_m == 32 and pg.down_config(16384, 112).tail_m == 32
    for cfg in (pg.gate_up_config(16384, 28, mxfp4=True), pg.down_config(16384, 112, mxfp4=True)):
        assert cfg.weights_lhs
