"""Triton grouped GEMMs (pallas_kernels/moe/triton/) in Pallas interpret mode on CPU.

Oracles: `lax.ragged_dot` in fp32 for the grouped GEMMs, the reference SiTU on fp32 gate/up for the fused
epilogue, and `experts_all_dense` / `experts_ragged_dot` for the whole routed-expert path. Group patterns
cover empty experts (first, middle, last), every row on one expert, sizes that are not multiples of the
row tile, single-row groups, rows past sum(group_sizes) (must come out zero) and M smaller than a tile.
The GPU path (Triton lowering) is checked by lowering for platform "cuda" on this CPU-only machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import experts_all_dense, experts_ragged_dot, routed_experts
from pallas_kernels.moe import triton as pg
from pallas_kernels.moe.reference import RAGGED_DIMS, situ
from tests.pallas_kernels.h200_lowering import lowered_for_h200
from tests.pallas_kernels.moe.routed import pallas_gpu_experts

F32 = jnp.float32
M, K, N, E = 200, 64, 64, 5
CFG = pg.TileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
GROUPS = {
    "uneven": [37, 0, 81, 45, 37],
    "empty_first_last": [0, 100, 0, 100, 0],
    "all_one_expert": [0, 0, 200, 0, 0],
    "last_only": [0, 0, 0, 0, 200],
    "single_rows": [1, 1, 1, 1, 196],
    "tail_rows_zero": [10, 20, 0, 30, 33],  # sum 93 < M: rows 93.. must be zeros (as lax.ragged_dot)
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ragged_f32(x, w, gs):
    return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DIMS, preferred_element_type=F32)


@functools.lru_cache(maxsize=None)
def operands(m: int = M, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (m, K), F32).astype(jnp.bfloat16) * 2
    w1 = (jax.random.normal(k[1], (E, N, K), F32) * K**-0.5 * 2).astype(jnp.bfloat16)  # gates reach the cap
    w3 = (jax.random.normal(k[2], (E, N, K), F32) * K**-0.5).astype(jnp.bfloat16)
    return x, w1, w3


@pytest.mark.parametrize("name", list(GROUPS))
def test_schedule_covers_each_row_once_per_column_block(name: str) -> None:
    gs = np.asarray(GROUPS[name])
    nb = 3
    table = np.asarray(pg.schedule(jnp.asarray(gs, jnp.int32), M, CFG.block_m, nb))
    assert table.shape == ((-(-M // CFG.block_m) + E) * nb, 4)
    owner = np.repeat(np.arange(E + 1), np.append(gs, M - gs.sum()))  # group of each row; E = tail
    hits = np.zeros((nb, M), int)
    for start, end, grp, j in table:
        if start >= end:
            continue
        assert end - start <= CFG.block_m
        assert np.all(owner[start:end] == grp), (start, end, grp)  # a tile never straddles two experts
        hits[j, start:end] += 1
    np.testing.assert_array_equal(hits, 1)


@pytest.mark.parametrize("name", list(GROUPS))
def test_grouped_matmul_matches_ragged_dot(name: str) -> None:
    x, w1, _ = operands()
    gs = jnp.asarray(GROUPS[name], jnp.int32)
    out = pg.grouped_matmul(x, w1, gs, cfg=CFG, out_dtype=F32, interpret=True)
    ref = ragged_f32(x, w1, gs)
    assert out.shape == (M, N) and out.dtype == F32
    # Same bf16 products summed in fp32 in another order: a few fp32 ulps.
    assert rel(out, ref) < 1e-5
    tail = int(gs.sum())
    np.testing.assert_array_equal(np.asarray(out[tail:]), 0.0)


@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("name", list(GROUPS))
def test_gate_up_situ_matches_reference(name: str, linear_beta: float | None) -> None:
    x, w1, w3 = operands()
    gs = jnp.asarray(GROUPS[name], jnp.int32)
    out = pg.grouped_gate_up_situ(x, w1, w3, gs, beta=4.0, linear_beta=linear_beta, cfg=CFG, out_dtype=F32,
                                  interpret=True)
    ref = situ(ragged_f32(x, w1, gs), ragged_f32(x, w3, gs), 4.0, linear_beta)  # fp32 in, fp32 out
    assert rel(out, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out[int(gs.sum()):]), 0.0)


def test_bf16_output_and_default_tiles() -> None:
    """Default (GPU) tile sizes, bf16 out: error is the bf16 output rounding (~2^-9 relative)."""
    x, w1, w3 = operands(m=300, seed=1)
    w1 = jnp.concatenate([w1, w1], 1)  # N = 128 fits the default 128-column block
    w3 = jnp.concatenate([w3, w3], 1)
    gs = jnp.asarray([70, 0, 33, 150, 47], jnp.int32)
    out = pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=pg.GATE_UP_DEFAULT, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert rel(out, situ(ragged_f32(x, w1, gs), ragged_f32(x, w3, gs), 4.0, 25.0)) < 4e-3


def test_fewer_rows_than_a_tile() -> None:
    x, w1, w3 = operands(m=20, seed=2)
    gs = jnp.asarray([0, 7, 0, 13, 0], jnp.int32)
    out = pg.grouped_gate_up_situ(x, w1, w3, gs, cfg=CFG, out_dtype=F32, interpret=True)
    assert out.shape == (20, N)
    assert rel(out, situ(ragged_f32(x, w1, gs), ragged_f32(x, w3, gs), 4.0, 25.0)) < 1e-5


def test_rejects_widths_that_do_not_tile() -> None:
    x, w1, _ = operands()
    with pytest.raises(ValueError):
        pg.grouped_matmul(x[:, :48], w1[:, :, :48], jnp.asarray(GROUPS["uneven"], jnp.int32), cfg=CFG,
                          interpret=True)


# ---- whole routed-expert path ---------------------------------------------------------------------


def expert_case(rng, n, e, k, din, f, dout, ids=None, dtype=np.float32):
    x = rng.standard_normal((n, din)) * 2.0
    w1 = rng.standard_normal((e, f, din)) / np.sqrt(din) * 1.5
    w3 = rng.standard_normal((e, f, din)) / np.sqrt(din)
    w2 = rng.standard_normal((e, dout, f)) / np.sqrt(f)
    if ids is None:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    weights = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), cast(w1), cast(w2), cast(w3), jnp.asarray(weights), jnp.asarray(ids, jnp.int32)


def expert_cases():
    rng = np.random.default_rng(5)
    return {
        # widths 24 / 40 / 20 are not multiples of 16: exercises the zero padding in pallas_gpu
        "random_odd_widths": expert_case(rng, 37, 8, 3, 24, 40, 20),
        # every token on experts 5, 1, 6: three groups hold all rows, the first, last and others are empty
        "all_same": expert_case(rng, 9, 8, 3, 32, 48, 32, ids=np.tile([5, 1, 6], (9, 1))),
    }


@pytest.mark.parametrize("name", ["random_odd_widths", "all_same"])
def test_routed_experts_pallas_matches_dense_oracle(name: str) -> None:
    x, w1, w2, w3, weights, ids = expert_cases()[name]
    # jit the whole path: one compile instead of one per eager op (keeps this file well under a minute)
    pallas = jax.jit(functools.partial(routed_experts, beta=4.0, linear_beta=25.0, implementation="pallas_gpu"))
    out = pallas(x, w1, w2, w3, weights, ids)
    dense = experts_all_dense(x, w1, w2, w3, weights, ids, beta=4.0, linear_beta=25.0)
    assert out.shape == dense.shape and out.dtype == F32
    assert rel(out, dense) < 1e-5  # fp32 end to end (interpret mode), different summation order only


def test_routed_experts_pallas_bf16_close_to_xla_path() -> None:
    rng = np.random.default_rng(6)
    x, w1, w2, w3, weights, ids = expert_case(rng, 64, 8, 4, 64, 96, 64, dtype=jnp.bfloat16)
    out = jax.jit(functools.partial(pallas_gpu_experts, beta=4.0, linear_beta=None))(
        x, w1, w2, w3, weights, ids)
    xla = jax.jit(functools.partial(experts_ragged_dot, beta=4.0, linear_beta=None))(x, w1, w2, w3, weights, ids)
    f32 = [a.astype(F32) for a in (x, w1, w2, w3)]
    oracle = experts_all_dense(*f32, weights, ids, beta=4.0, linear_beta=None)
    # Ours rounds once (the bf16 hidden state); the XLA path also rounds gate and up to bf16 before SiTU.
    assert rel(out, oracle) < 1e-2
    assert rel(out, oracle) <= rel(xla, oracle) * 1.5


# ---- GPU lowering, checked on CPU ------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gate_up", "gate_up_small_groups", "down"])
def test_lowers_to_triton_for_cuda(which: str) -> None:
    """Pallas -> Triton IR for the K3 shapes and default tiles, as the H200 would compile (no GPU needed)."""
    m, h, f = 16384, 3584, 3072
    experts = 112 if which == "gate_up_small_groups" else 28
    sds = jax.ShapeDtypeStruct
    gs = sds((experts,), jnp.int32)
    if which == "down":
        fn = pg.grouped_matmul
        args = (sds((m, f), jnp.bfloat16), sds((experts, h, f), jnp.bfloat16), gs)
    else:
        fn = pg.grouped_gate_up_situ
        w = sds((experts, f, h), jnp.bfloat16)
        args = (sds((m, h), jnp.bfloat16), w, w, gs)
    text = lowered_for_h200(fn, *args)
    assert "__gpu$xla.gpu.triton" in text
