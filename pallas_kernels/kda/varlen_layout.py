"""Chunk-aligned layout of packed variable-length sequences, built on the host.

The chunked kernels treat a chunk as one unit of the recurrence, so a chunk must not hold tokens
of two sequences. Packed sequences ``[1, T, ...]`` (offsets ``cu_seqlens [N + 1]``) are therefore
moved into a layout where every sequence starts on a chunk boundary and is padded up to a multiple
of the chunk: ``Tp = sum_i ceil(len_i / C) * C <= T + N * (C - 1)``. Unlike padding to a batch
``[N, max_len]`` this costs at most one partial chunk per sequence, whatever the length mix.
Padding slots take a caller-chosen fill value that makes the step an identity (k = v = beta = 0,
g = 0 for pre-activated inputs; -inf gate / beta logits for the fused activations).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Index maps between the packed and the chunk-aligned layout.

    ``src [Tp]``: the packed token held by each aligned slot (``T`` for padding, out of range so
    the gather fills it). ``dst [T]``: the aligned slot of each packed token. ``chunk_offsets``
    int32 ``[N + 1]``: sequence ``i`` owns the aligned chunks from ``chunk_offsets[i]`` up to
    ``chunk_offsets[i + 1]``.
    """

    src: np.ndarray
    dst: np.ndarray
    chunk_offsets: np.ndarray


def chunk_layout(offsets: np.ndarray, chunk: int) -> ChunkLayout:
    """The layout for validated host offsets ``[N + 1]`` (see ``reference.host_offsets``)."""
    lens = np.diff(offsets)
    n_chunks = -(-lens // chunk)
    chunk_offsets = np.concatenate([[0], np.cumsum(n_chunks)]).astype(np.int32)
    total = int(offsets[-1])
    src = np.full(int(chunk_offsets[-1]) * chunk, total, np.int64)
    seq = np.repeat(np.arange(lens.size), lens)  # packed token -> its sequence
    dst = chunk_offsets[seq].astype(np.int64) * chunk + (np.arange(total) - offsets[seq])
    src[dst] = np.arange(total)
    return ChunkLayout(src=src, dst=dst, chunk_offsets=chunk_offsets)


def to_aligned(x: jax.Array, layout: ChunkLayout, fill: float = 0.0) -> jax.Array:
    """[1, T, ...] packed -> [1, Tp, ...] chunk-aligned, padding slots set to ``fill``."""
    return jnp.take(x, jnp.asarray(layout.src), axis=1, mode="fill", fill_value=fill)


def from_aligned(y: jax.Array, layout: ChunkLayout) -> jax.Array:
    """[1, Tp, ...] chunk-aligned -> [1, T, ...] packed (padding slots dropped)."""
    return jnp.take(y, jnp.asarray(layout.dst), axis=1)
