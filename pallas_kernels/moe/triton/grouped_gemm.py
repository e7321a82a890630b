"""The Triton grouped GEMMs' entry points: fused gate+up+SiTU and the plain grouped product.

Rows of ``x`` [M, K] are sorted by expert; ``group_sizes`` [E] (int32) counts each expert's rows; rows
past ``sum(group_sizes)`` come out as zeros, as in ``lax.ragged_dot``. bf16 operands, fp32 accumulation,
output in ``x.dtype`` unless asked otherwise. K and N must be multiples of the tiles' block_k / block_n
(`tiles.fit_config` fits them; `pallas_gpu` zero-pads odd toy widths).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.moe.triton.kernel import Weight, grouped_call
from pallas_kernels.moe.triton.tiles import TileConfig, down_config, gate_up_config
from pallas_kernels.mxfp4 import MXFP4Experts


@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "cfg", "out_dtype", "interpret"))
def grouped_gate_up_situ(
    x: jax.Array, w1: Weight, w3: Weight, group_sizes: jax.Array, *, beta: float = 4.0,
    linear_beta: float | None = 25.0, cfg: TileConfig | None = None, out_dtype=None, interpret: bool = False,
) -> jax.Array:
    """SiTU(x @ w1_e^T, x @ w3_e^T) for rows grouped by expert. x [M, K]; w1, w3 [E, F, K] -> [M, F].

    cfg: None picks `gate_up_config(M, E, packed)`. Off interpret mode the epilogue's two tanh terms and
    its sigmoid take the GPU's approximate instructions (their error sits below the bf16 output's
    rounding); interpret mode runs the exact ops."""
    cfg = cfg or gate_up_config(x.shape[0], w1.shape[0], isinstance(w1, MXFP4Experts))
    return grouped_call(x, (w1, w3), group_sizes, cfg=cfg, fused=True, beta=beta, linear_beta=linear_beta,
                        out_dtype=out_dtype or x.dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "out_dtype", "interpret", "weights_kn"))
def grouped_matmul(
    x: jax.Array, w: Weight, group_sizes: jax.Array, *, cfg: TileConfig | None = None, out_dtype=None,
    interpret: bool = False, weights_kn: bool = False,
) -> jax.Array:
    """x @ w_e^T for rows grouped by expert (fp32 accumulation). x [M, K]; w [E, N, K] -> [M, N].

    cfg: None picks `down_config(M, E, packed)`. weights_kn: w is [E, K, N] and the result x @ w_e (dense
    weights): the backward multiplies by the forward's weights untransposed (dh = dy W2_e with W2
    [E, out, F]), and loading [bk, bn] tiles of them costs nothing where a transposed copy would read and
    write the whole layer."""
    cfg = cfg or down_config(x.shape[0], w.shape[0], isinstance(w, MXFP4Experts))
    return grouped_call(x, (w,), group_sizes, cfg=cfg, fused=False, beta=None, linear_beta=None,
                        out_dtype=out_dtype or x.dtype, interpret=interpret, kn=weights_kn)
