"""The default prefill chunk: the stated rule on K3's and the tiny model's widths."""

from __future__ import annotations

import pytest

from k3jax.config import K3Config
from k3jax.prefill_chunk import (
    ACTIVATION_SHARE, MAX_CHUNK, MIN_CHUNK, activation_bytes_per_token, default_chunk_size, device_memory_bytes,
)
from tests.conftest import GOLDEN_DIR

K3 = K3Config.from_hf("configs/kimi_k3.json")


def test_no_memory_limit_means_the_whole_prompt():
    assert default_chunk_size(K3, 1, None) is None
    assert device_memory_bytes() is None  # the CPU backend reports no limit


@pytest.mark.parametrize("memory,batch", [(141e9, 1), (95e9, 1), (80e9, 4), (16e9, 1)])
def test_chunk_is_the_largest_power_of_two_within_the_share(memory, batch):
    chunk = default_chunk_size(K3, batch, int(memory))
    per_token = activation_bytes_per_token(K3)
    assert MIN_CHUNK <= chunk <= MAX_CHUNK and chunk & (chunk - 1) == 0
    assert chunk == MIN_CHUNK or chunk * batch * per_token <= memory / ACTIVATION_SHARE
    assert chunk == MAX_CHUNK or 2 * chunk * batch * per_token > memory / ACTIVATION_SHARE


def test_k3_per_token_estimate_and_the_tiny_model():
    # K3: routed experts (16 x (2 x 3584 + 3 x 3072) bf16) dominate, ~1 MB a token in all.
    assert 0.5e6 < activation_bytes_per_token(K3) < 2e6
    assert default_chunk_size(K3, 1, int(141e9)) == 8192 and default_chunk_size(K3, 64, int(141e9)) == 256
    tiny = K3Config.from_hf(GOLDEN_DIR)
    assert default_chunk_size(tiny, 1, 1 << 30) == MAX_CHUNK
