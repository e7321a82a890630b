"""Fragment order: a permutation of the K columns that lets each GPU thread read its MXFP4 bytes contiguously.

With the decoded weight tile as the left wgmma operand (bf16, 8 warps), the thread with lane index t (mod 4)
holds, in every 16 columns of a k step, the column pairs (2t, 2t+1) and (2t+8, 2t+9): the packed bytes
t and t+4. Over a k step of block_k columns (block_k / 2 bytes) that is every fourth byte, t + 4i, so in
the release order the kernel gathers its bytes one at a time (ld.shared.u8 and byte permutes: about 80 of
the ~460 SASS instructions per thread and k step of the fused gate+up kernel, sm_90, Triton 3.6).

Fragment order regroups each k step's bytes so that logical byte L = 4i + t reads physical byte
P = (block_k / 8) t + i: each thread's bytes become one contiguous run (an 8-byte load at block_k = 64;
the same kernel then runs ~390 instructions). The dot is a sum over K, so it is unchanged if x's columns
are permuted the same way: x_fragment = x[:, fragment_order(K, block_k)], which the caller does once
(e.g. inside the gather that sorts rows by expert, where it is free). Pure relabelling, exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

THREADS_PER_ROW = 4  # lanes that share a row of the wgmma A fragment


def fragment_order(k: int, block_k: int) -> np.ndarray:
    """Column permutation p of K (x_fragment = x[:, p]) for packed weights decoded in fragment order."""
    if block_k % 32 or k % block_k:
        raise ValueError(f"fragment order needs block_k={block_k} a multiple of 32 (an MXFP4 k step) dividing K={k}")
    per_thread = block_k // 8  # bytes per thread and row in one k step
    logical = np.arange(block_k // 2)
    i, t = np.divmod(logical, THREADS_PER_ROW)
    physical = per_thread * t + i  # byte read for logical byte L = 4 i + t
    step = np.stack([2 * physical, 2 * physical + 1], axis=-1).reshape(-1)  # codes: low nibble, high nibble
    return (np.arange(0, k, block_k)[:, None] + step[None, :]).reshape(-1)


def bytes_in_fragment_order(tile: jax.Array) -> jax.Array:
    """[R, block_k / 2] bytes (or per-byte values) of one k step, release order -> fragment order."""
    rows, half = tile.shape
    return jnp.swapaxes(tile.reshape(rows, THREADS_PER_ROW, half // THREADS_PER_ROW), 1, 2).reshape(rows, half)
