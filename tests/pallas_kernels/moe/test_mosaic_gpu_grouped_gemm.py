"""The Mosaic GPU grouped GEMMs (``moe/mosaic_gpu/grouped_gemm.py``: gate+up with SiTU, and the plain
down projection) in Mosaic GPU's CPU interpreter against per-expert fp32 products, their work table,
and their lowering for an abstract H200.

Tolerance: bf16 operands with fp32 accumulation, SiTU in fp32, then one rounding to the bf16
output (relative 2^-9 per element: 1.7e-3 seen over a whole output); 1e-2 leaves room for that,
while a wrong expert, row offset or column block is off by O(1). Rows of no expert must be exactly
zero and rows of other tiles untouched, so those are checked exactly.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import pallas_gpu
from pallas_kernels.moe.mosaic_gpu import TAIL_ROWS, gate_up_situ_mgpu, grouped_matmul_mgpu, sm_count
from pallas_kernels.moe.mosaic_gpu.work import ALIGN, ROWS, work_table
from pallas_kernels.moe.reference import situ
from tests.pallas_kernels.h200_lowering import lowered_for_h200

_BF16, _F32 = jnp.bfloat16, jnp.float32
TOL = 1e-2


def _expected(x, w1, w3, sizes) -> np.ndarray:
    """Per-expert fp32 products and SiTU (the plain product with w3 None); rows past sum(sizes)
    zero."""
    out = np.zeros((x.shape[0], w1.shape[1]), np.float32)
    xs, start = x.astype(_F32), 0
    for e, count in enumerate(sizes):
        rows = xs[start:start + count]
        gate = rows @ w1[e].astype(_F32).T
        out[start:start + count] = gate if w3 is None else situ(gate, rows @ w3[e].astype(_F32).T,
                                                                4.0, 25.0)
        start += count
    return out


def _assert_matches(out, want, sizes) -> None:
    """Within TOL over the used rows and for each expert on its own; rows past them exactly 0."""
    got, used = np.asarray(out.astype(_F32)), sum(sizes)
    assert np.linalg.norm(got[:used] - want[:used]) <= TOL * np.linalg.norm(want[:used])
    for e, start in enumerate(np.cumsum([0] + sizes[:-1])):  # each expert on its own
        rows = slice(start, start + sizes[e])
        assert np.linalg.norm(got[rows] - want[rows]) <= TOL * max(np.linalg.norm(want[rows]), 1e-6)
    assert np.all(got[used:] == 0)


def _case(seed: int, m: int, e: int, k: int = 128, n: int = 256):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((m, k)), _BF16)
    w1, w3 = (jnp.asarray(r.standard_normal((e, n, k)) / np.sqrt(k), _BF16) for _ in range(2))
    return x, w1, w3


# unaligned expert starts with an empty expert and rows of no expert; every row to one expert;
# fewer rows than a tile (x padded); a row count that is no multiple of 8 (the last tile reads
# past x)
@pytest.mark.parametrize("m, sizes", [(300, [100, 0, 150]), (256, [0, 256, 0]), (40, [7, 33, 0]),
                                      (301, [1, 170, 130])],
                         ids=["empty expert and spare rows", "one expert", "rows < tile",
                              "M % 8 != 0"])
def test_matches_per_expert_products(m: int, sizes: list[int]) -> None:
    x, w1, w3 = _case(0, m, len(sizes))
    used = sum(sizes)
    x = x.at[used:].set(jnp.nan)  # rows of no expert: never multiplied, stored as zeros
    out = gate_up_situ_mgpu(x, w1, w3, jnp.asarray(sizes, jnp.int32), num_sms=4, interpret=True)
    assert out.shape == (m, w1.shape[1]) and out.dtype == _BF16
    _assert_matches(out, _expected(x, w1, w3, sizes), sizes)


# the plain product's 256-column tiles stage their output in two 128-column halves (n=512: two
# column blocks); the second warpgroup's rows of a tile past its expert (40 rows) store nothing
@pytest.mark.parametrize("m, sizes", [(300, [100, 0, 150]), (40, [7, 33, 0]), (301, [1, 170, 130])],
                         ids=["empty expert and spare rows", "rows < tile", "M % 8 != 0"])
def test_plain_product_matches_per_expert_products(m: int, sizes: list[int]) -> None:
    x, w, _ = _case(3, m, len(sizes), n=512)
    x = x.at[sum(sizes):].set(jnp.nan)
    out = grouped_matmul_mgpu(x, w, jnp.asarray(sizes, jnp.int32), num_sms=3, interpret=True)
    assert out.shape == (m, w.shape[1]) and out.dtype == _BF16
    _assert_matches(out, _expected(x, w, None, sizes), sizes)


# a group that fits one tile with its tail (150), one just past it (161: two 128-row tiles, no
# tail); an empty expert and 150 rows of no expert (zeros, merged); a group of three tiles (340)
# and a merged one at an unaligned start (150 from row 345); fewer rows than a tile (x
# padded to ROWS + TAIL_ROWS)
@pytest.mark.parametrize("m, sizes", [(400, [150, 161, 40, 9]), (400, [100, 0, 150]),
                                      (520, [3, 340, 2, 150]), (40, [7, 33, 0])],
                         ids=["tail and one past", "empty expert and spare rows", "three tiles",
                              "rows < tile"])
def test_tail_rows_match_per_expert_products(m: int, sizes: list[int]) -> None:
    """The tail: its rows multiplied by swapped wgmmas ([cols, rows] accumulators) and stored
    transposed, 64 columns of a warpgroup's 128 per round."""
    x, w1, w3 = _case(5, m, len(sizes))
    x = x.at[sum(sizes):].set(jnp.nan)
    out = gate_up_situ_mgpu(x, w1, w3, jnp.asarray(sizes, jnp.int32), num_sms=4,
                            tail_rows=TAIL_ROWS, interpret=True)
    assert out.shape == (m, w1.shape[1]) and out.dtype == _BF16
    _assert_matches(out, _expected(x, w1, w3, sizes), sizes)


# the plain product's tail: [128, 32] swapped accumulators, stored 64 columns at a time
@pytest.mark.parametrize("m, sizes", [(400, [150, 161, 40, 9]), (400, [100, 0, 150])],
                         ids=["tail and one past", "empty expert and spare rows"])
def test_plain_product_tail_rows(m: int, sizes: list[int]) -> None:
    x, w, _ = _case(6, m, len(sizes), n=512)
    x = x.at[sum(sizes):].set(jnp.nan)
    out = grouped_matmul_mgpu(x, w, jnp.asarray(sizes, jnp.int32), num_sms=3, tail_rows=TAIL_ROWS,
                              interpret=True)
    assert out.shape == (m, w.shape[1]) and out.dtype == _BF16
    _assert_matches(out, _expected(x, w, None, sizes), sizes)


def test_three_stages_agree_with_four() -> None:
    x, w1, w3 = _case(1, 200, 2, k=256)
    sizes = jnp.asarray([90, 110], jnp.int32)
    run = lambda s: gate_up_situ_mgpu(x, w1, w3, sizes, num_sms=2, stages=s, interpret=True)  # noqa: E731
    assert jnp.array_equal(run(3), run(4))


@pytest.mark.parametrize("tail_rows", [0, TAIL_ROWS])
@pytest.mark.parametrize("seed", range(3))
def test_work_table_covers_each_row_once(seed: int, tail_rows: int) -> None:
    """Every row of every column block stored by exactly one tile of its own expert, each tile
    storing rows of the ROWS it loads from a multiple of 8; with a tail, an expert's last tile
    also the next tail_rows, and only where that saves a tile."""
    r = np.random.default_rng(seed)
    e, blocks = 9, 3
    sizes = r.integers(0, 300, e) * (r.random(e) > 0.3)
    m = int(sizes.sum()) + int(r.integers(0, 50))
    table = np.asarray(work_table(jnp.asarray(sizes, jnp.int32), m, blocks, tail_rows=tail_rows))
    load, start, end, group, block = table.T
    expert_of_row = np.concatenate([np.repeat(np.arange(e), sizes), np.full(m - sizes.sum(), e)])
    live = end > start
    assert np.all(load[live] % ALIGN == 0)
    assert np.all((load[live] <= start[live]) & (end[live] <= load[live] + ROWS + tail_rows))
    group_end = np.cumsum(np.append(sizes, m - sizes.sum()))
    group_start = group_end - np.append(sizes, m - sizes.sum())
    merged = live & (end > load + ROWS)
    assert np.all(end[merged] == group_end[group[merged]])  # only an expert's last tile
    if tail_rows:  # a remainder that fits the tail is merged: no tile that short but a first
        short = live & (end - load <= tail_rows)
        assert np.all(start[short] == group_start[group[short]])
    covered = np.zeros((blocks, m), int)
    for lo, hi, g, b in zip(start[live], end[live], group[live], block[live]):
        assert np.all(expert_of_row[lo:hi] == g)
        covered[b, lo:hi] += 1
    assert np.all(covered == 1)


@pytest.mark.parametrize("weights_kn, out_dtype", [(False, _F32), (True, _BF16), (True, _F32)],
                         ids=["fp32 out", "[E, K, N] weights", "[E, K, N] weights, fp32 out"])
def test_plain_product_layouts_and_fp32_out(weights_kn: bool, out_dtype) -> None:
    """The backward's forms: weights stored [E, K, N] (multiplied as loaded) and fp32 outputs (the
    accumulator itself, staged 64 columns at a time). fp32 out differs from fp32 products only in
    summation order (1e-5 is ~100x what that gives), so a misplaced column block or staged half
    fails it as surely as the bf16 bound."""
    sizes = [100, 0, 150]
    x, w, _ = _case(4, 300, len(sizes), n=512)
    x = x.at[sum(sizes):].set(jnp.nan)
    out = grouped_matmul_mgpu(x, jnp.swapaxes(w, 1, 2) if weights_kn else w, jnp.asarray(sizes, jnp.int32),
                              out_dtype=out_dtype, weights_kn=weights_kn, num_sms=3, interpret=True)
    assert out.shape == (300, 512) and out.dtype == out_dtype
    want, got = _expected(x, w, None, sizes), np.asarray(out.astype(_F32))
    tol = 1e-5 if out_dtype == _F32 else TOL
    assert np.linalg.norm(got[:250] - want[:250]) <= tol * np.linalg.norm(want[:250])
    assert np.all(got[250:] == 0)


@pytest.mark.parametrize("m", [16384, 301])
def test_lowers_for_h200(m: int) -> None:
    """K3's per-GPU gate+up (3584 -> 2 x 3072) and down (3072 -> 3584), 28 experts: one Mosaic GPU
    custom call each, under the shared-memory budget of the layout inference. 301 rows: x's TMA
    descriptor needs a multiple of 8 (the interpreter does not check this; the lowering does)."""
    S = jax.ShapeDtypeStruct
    e, d, f = 28, 3584, 3072
    text = lowered_for_h200(lambda *a: gate_up_situ_mgpu(*a), S((m, d), _BF16), S((e, f, d), _BF16),
                            S((e, f, d), _BF16), S((e,), jnp.int32))
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 1
    assert "k3_moe_gate_up_situ_mgpu" in text
    text = lowered_for_h200(lambda *a: grouped_matmul_mgpu(*a), S((m, f), _BF16), S((e, d, f), _BF16),
                            S((e,), jnp.int32))
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 1
    assert "k3_moe_grouped_matmul_mgpu" in text
    # the tail's swapped wgmmas and second set of accumulators, at 112 experts (146 rows each)
    text = lowered_for_h200(lambda *a: gate_up_situ_mgpu(*a, tail_rows=TAIL_ROWS), S((m, d), _BF16),
                            S((4 * e, f, d), _BF16), S((4 * e, f, d), _BF16), S((4 * e,), jnp.int32))
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 1
    text = lowered_for_h200(lambda *a: grouped_matmul_mgpu(*a, tail_rows=TAIL_ROWS), S((m, f), _BF16),
                            S((4 * e, d, f), _BF16), S((4 * e,), jnp.int32))
    assert len(re.findall(r"custom_call @mosaic_gpu_v2\(", text)) == 1
    # the backward's dx: [E, K, N] weights, fp32 out
    text = lowered_for_h200(lambda *a: grouped_matmul_mgpu(*a, out_dtype=_F32, weights_kn=True),
                            S((m, f), _BF16), S((e, f, d), _BF16), S((e,), jnp.int32))
    assert "k3_moe_grouped_matmul_mgpu" in text


def test_one_persistent_cta_per_sm_of_the_target_gpu() -> None:
    """The CTA count follows the GPU traced for (an H100 PCIe has 114 SMs: 132 CTAs there would
    run 18 in a second wave); 132 without a GPU."""
    pcie = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 PCIe", num_cores=114, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=pcie)):
        assert sm_count() == 114
    device = jax.devices()[0]
    assert sm_count() == (device.core_count if device.platform == "gpu" else 132)


def test_rejects_what_it_cannot_take() -> None:
    x, w1, w3 = _case(2, 64, 2)
    sizes = jnp.asarray([32, 32], jnp.int32)
    with pytest.raises(ValueError, match=r"^gate_up_situ_mgpu: wants bf16 x .* got x float32"):
        gate_up_situ_mgpu(x.astype(_F32), w1, w3, sizes, interpret=True)
    with pytest.raises(ValueError, match=r"N % 128 == 0, .* weights bfloat16 \(2, 192, 128\)"):
        gate_up_situ_mgpu(x, w1[:, :192], w3[:, :192], sizes, interpret=True)
    with pytest.raises(ValueError, match=r"^gate_up_situ_mgpu: .* of one shape"):
        gate_up_situ_mgpu(x, w1, w3[:1], sizes, interpret=True)
    with pytest.raises(ValueError, match=r"^gate_up_situ_mgpu: tail_rows=16, expected 0 or 32"):
        gate_up_situ_mgpu(x, w1, w3, sizes, tail_rows=16, interpret=True)
    with pytest.raises(ValueError, match=r"^grouped_matmul_mgpu: tail_rows=32 wants bf16 out .* float32"):
        grouped_matmul_mgpu(x, w1, sizes, tail_rows=TAIL_ROWS, out_dtype=_F32, interpret=True)
    with pytest.raises(ValueError, match=r"^grouped_matmul_mgpu: .* N % 256 == 0, .* \(2, 128, 128\)"):
        grouped_matmul_mgpu(x, w1[:, :128], sizes, interpret=True)
    with pytest.raises(ValueError, match=r"^grouped_matmul_mgpu: .* weights \[E, K, N\] .* \(2, 256, 128\)"):
        grouped_matmul_mgpu(x, w1, sizes, weights_kn=True, interpret=True)  # K 256 != x's 128


@pytest.mark.parametrize("experts", [28, 112])
def test_expert_mlp_forward_takes_them_past_decode_sizes(experts: int) -> None:
    """The routed experts' forward on the GPU (lowered for an abstract H200, K3 widths, 16384
    rows): gate+up and down in the Mosaic GPU kernels, with merged tails at 112 experts (146 rows
    each). A decode-sized batch (256 rows) keeps both Triton kernels."""
    S = jax.ShapeDtypeStruct
    d, f = 3584, 3072

    def lowered(m: int) -> str:
        args = (S((m, d), _BF16), S((experts,), jnp.int32), S((experts, f, d), _BF16),
                S((experts, d, f), _BF16), S((experts, f, d), _BF16))
        return lowered_for_h200(lambda rows, gs, w1, w2, w3: pallas_gpu.grouped_mlp(
            rows, gs, w1, w2, w3, beta=4.0, linear_beta=25.0), *args)

    text = lowered(16384)
    assert "k3_moe_gate_up_situ_mgpu" in text and "k3_moe_grouped_matmul_mgpu" in text
    assert text.count("__gpu$xla.gpu.triton") == 0
    assert text.count("mosaic_gpu_v2(") == 2
    text = lowered(256)
    assert "mosaic_gpu_v2(" not in text and text.count("__gpu$xla.gpu.triton") == 2


def _plan(rows: int, experts: int, *, packed: bool = False, dtype=_BF16, interpret: bool = False,
          d: int = 3584, f: int = 3072) -> pallas_gpu.KernelPlan:
    return pallas_gpu.plan_kernels(dtype=dtype, weight_dtype=dtype, packed=packed, num_rows=rows,
                                   num_experts=experts, d_in=d, hidden=f, d_out=d, interpret=interpret)


@pytest.mark.parametrize("rows, experts, tail", [(16384, 28, 0), (16384, 112, TAIL_ROWS), (256, 28, None)])
def test_plan_picks_the_tail_per_group_size(rows: int, experts: int, tail: int | None) -> None:
    """Both forward products take the merged tail at 112 experts (146 rows each), plain tiles at 28
    (585), the Triton kernels at a decode-sized batch; the backward's products with the forward's
    weights take Mosaic GPU for large groups only; the interpreter, fp32 and widths that do not tile
    its blocks never take the Mosaic GPU products."""
    plan = _plan(rows, experts)
    mosaic = "triton" if tail is None else "mosaic_gpu"
    assert (plan.gate_up, plan.down) == (mosaic, mosaic)
    if tail is not None:
        assert plan.tail_rows == tail
    backward = "mosaic_gpu" if tail == 0 else "triton"
    assert (plan.recompute, plan.dh, plan.dx) == (backward,) * 3
    for other in (_plan(rows, experts, interpret=True), _plan(rows, experts, dtype=_F32),
                  _plan(rows, experts, d=3536)):
        assert {other.gate_up, other.down, other.recompute, other.dh, other.dx} == {"triton"}
