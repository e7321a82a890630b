"""The transposed grouped GEMM of the weight gradients, in Pallas-Triton: a contraction over each
group's rows, one [P, Q] block per expert.

Per group e: a_e^T b_e, equal to `lax.ragged_dot_general` with a ragged contracting dimension. One
program per (expert, output tile) loops over the expert's row tiles (expert load imbalance is not split
across programs); rows of other groups are zeroed by a masked load of a, so the tile goes from the async
copy straight to the MMA's shared memory (a select after the load would change it in registers first,
and ran markedly slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.moe.triton.tiles import TN_DEFAULT, TileConfig

F32 = jnp.float32


def _tn_kernel(bounds_ref, a_ref, b_ref, o_ref, *, num_rows, bm, bp, bq):
    """Program (e, i, j): o[e, i-block, j-block] = sum over rows r of group e of a[r, i-block]^T b[r, j-block]."""
    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = bounds_ref[e, 0]
    end = bounds_ref[e, 1]
    p0 = pl.multiple_of(i * bp, bp)
    q0 = pl.multiple_of(j * bq, bq)

    def body(t, acc):
        r0 = start + t * bm
        load_start = jnp.minimum(r0, num_rows - bm)  # full bm-row loads stay in bounds; rows outside masked
        rows = load_start + jax.lax.broadcasted_iota(jnp.int32, (bm, bp), 0)
        keep = (rows >= r0) & (rows < end)
        at = pltr.load(a_ref.at[pl.ds(load_start, bm), pl.ds(p0, bp)], mask=keep, other=0.0)
        bt = b_ref[pl.ds(load_start, bm), pl.ds(q0, bq)]
        dims = (((0,), (0,)), ((), ()))  # a [bm, bp]^T . b [bm, bq]
        return acc + jax.lax.dot_general(at, bt, dims, preferred_element_type=F32)

    num_t = (end - start + bm - 1) // bm
    acc = jax.lax.fori_loop(0, num_t, body, jnp.zeros((bp, bq), F32))  # empty group: zeros
    o_ref[e, pl.ds(p0, bp), pl.ds(q0, bq)] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret"))
def grouped_matmul_tn(
    a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, cfg: TileConfig | None = None, out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """Per group e: a_e^T @ b_e (fp32 accumulation), the weight-gradient GEMM. a [M, P]; b [M, Q] -> [E, P, Q].

    Rows of a and b are grouped as in `grouped_matmul`; rows past sum(group_sizes) are ignored and empty
    groups give zeros. cfg.block_m is the P tile, cfg.block_n the Q tile, cfg.block_k the row
    (contraction) tile; P, Q must be multiples of block_m, block_n (`tiles.fit_tn_config`)."""
    cfg = cfg or TN_DEFAULT
    (m0, p), (mb, q) = a.shape, b.shape
    bp, bq, bm = cfg.block_m, cfg.block_n, cfg.block_k
    if mb != m0 or p % bp or q % bq:
        raise ValueError(f"a {a.shape}, b {b.shape}: same rows, P % {bp} == 0 and Q % {bq} == 0 required")
    if m0 < bm:  # tiny inputs: pad rows so a full row tile is always in bounds
        a, b = (jnp.pad(z, ((0, bm - m0), (0, 0))) for z in (a, b))
    m = a.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m0)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    bounds = jnp.stack([starts, ends], axis=1).astype(jnp.int32)  # [E, 2]
    num_groups = group_sizes.shape[0]
    kernel = functools.partial(_tn_kernel, num_rows=m, bm=bm, bp=bp, bq=bq)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, p, q), out_dtype or a.dtype),
        grid=(num_groups, p // bp, q // bq),
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="k3_moe_grouped_matmul_tn",
    )(bounds, a, b)
