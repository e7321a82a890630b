"""The per-leaf checksum is zlib's CRC-32 of the leaf's bytes, however it is split over threads."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from k3jax.checkpoint import checksum
from k3jax.checkpoint.store import leaf_record


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 1000, 4097])
def test_chunked_crc32_equals_zlib_over_the_whole(size, monkeypatch):
    monkeypatch.setattr(checksum, "CHUNK_BYTES", 100)  # many chunks, a short last one
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8)
    assert checksum.crc32_of(data) == zlib.crc32(data.tobytes())


def test_combine_of_any_split():
    data = np.random.default_rng(0).integers(0, 256, 3000, np.uint8).tobytes()
    for cut in [0, 1, 1024, 2999, 3000]:
        a, b = data[:cut], data[cut:]
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_leaf_record_is_the_crc32_of_the_c_order_bytes():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4).astype(ml_dtypes.bfloat16)
    record = leaf_record(array.transpose(1, 0, 2))  # a non-contiguous view: its values in C order
    assert record == {"shape": [3, 2, 4], "dtype": "bfloat16",
                      "crc32": f"{zlib.crc32(np.ascontiguousarray(array.transpose(1, 0, 2)).tobytes()):08x}"}
    changed = array.copy()
    changed[1, 2, 3] = 0
    assert leaf_record(changed)["crc32"] != leaf_record(array)["crc32"]
