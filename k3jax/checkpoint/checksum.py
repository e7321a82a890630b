"""The per-leaf checksum of a conversion: zlib's CRC-32 of the leaf's bytes in C order.

It is there to detect corruption and differences (a resumed run against what was written, `--verify`
against a re-read of the source), not to authenticate: a CRC is no defence against deliberate edits.
CRC-32 is faster per core than any hashlib digest (see benchmarks/RESULTS.md), and unlike a digest
it can be computed over chunks on several threads and combined exactly:
`crc32_of` gives `zlib.crc32(array.tobytes())` bit for bit, so anyone can recompute a recorded value.

Combining: with F = 0xFFFFFFFF, zlib's crc32(M) = raw(F, M) ^ F, where raw(s, M) runs the CRC
register from state s over M; raw is affine in s, raw(s, M) = Z_|M|(s) ^ raw(0, M), with Z_n the
linear map "feed n zero bytes". Expanding both sides gives crc32(A + B) = Z_|B|(crc32(A)) ^ crc32(B).
Z_n is a 32x32 matrix over GF(2) (one 32-bit column per input bit), built from Z_1 by squaring.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

ALGORITHM = "crc32"
CHUNK_BYTES = 32 << 20  # work unit of the threads; zlib releases the GIL while it runs
_F = 0xFFFFFFFF
_POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="k3jax-crc32")


def _apply(matrix: tuple[int, ...], vector: int) -> int:
    out, bit = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[bit]
        vector >>= 1
        bit += 1
    return out


@lru_cache(maxsize=None)
def _zeros_operator(log2_bytes: int) -> tuple[int, ...]:
    """Z_(2^log2_bytes): columns are the images of the 32 single-bit register states."""
    if log2_bytes == 0:
        return tuple(zlib.crc32(b"\0", (1 << i) ^ _F) ^ _F for i in range(32))
    half = _zeros_operator(log2_bytes - 1)
    return tuple(_apply(half, column) for column in half)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of A + B from CRC-32(A), CRC-32(B) and len(B)."""
    bit = 0
    while len_b:
        if len_b & 1:
            crc_a = _apply(_zeros_operator(bit), crc_a)
        len_b >>= 1
        bit += 1
    return crc_a ^ crc_b


def crc32_of(array: np.ndarray) -> int:
    """`zlib.crc32` of the array's bytes in C order, over CHUNK_BYTES chunks on all cores."""
    data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    crcs = _POOL.map(zlib.crc32, chunks) if len(chunks) > 1 else map(zlib.crc32, chunks)
    crc = 0
    for chunk, chunk_crc in zip(chunks, crcs):
        crc = crc32_combine(crc, chunk_crc, len(chunk))
    return crc
