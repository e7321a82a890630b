"""The default prefill chunk: how many prompt tokens one prefill call runs, from the model's widths and
the device's memory.

A long prompt is prefilled in chunks (`k3jax.prefill`): each chunk appends to the cache and keeps only
what the next chunk needs, so activation memory follows the chunk, not the prompt. The rule:

    chunk = the largest power of two in [MIN_CHUNK, MAX_CHUNK] with
            chunk * batch * activation_bytes_per_token(cfg) <= device memory / ACTIVATION_SHARE

`activation_bytes_per_token` adds up the per-token tensors one layer holds at its widest point (the
AttnRes stream, the mixer's projections, the routed experts' hidden rows); the remaining
(ACTIVATION_SHARE - 1) / ACTIVATION_SHARE of the memory is left to weights and caches. A device that
reports no memory limit (the CPU backend) gets None: the whole prompt in one call. The memory planner
(`k3jax plan`) plans the prefill program at this same chunk.
"""

from __future__ import annotations

import jax

from k3jax.config import K3Config

MIN_CHUNK = 256
MAX_CHUNK = 8192
ACTIVATION_SHARE = 8  # activations of one chunk may use 1/8 of the device's memory


def activation_bytes_per_token(cfg: K3Config) -> int:
    """Bytes one prompt token needs at a layer's widest point (an estimate that errs high):
    the fp32 AttnRes bank and partial sum, the widest mixer's projections (KDA q|k|v, conv output,
    fp32 gates; MLA queries, output and gate), and the routed experts' rows (in, gate|up, out)."""
    act = 4 if cfg.dtype == "float32" else 2
    stream = (cfg.num_attn_res_blocks + 2) * cfg.hidden_size * 4
    kda = cfg.kda_proj_dim * (3 * act + 3 * act + 4 + 2 * act)
    mla = cfg.mla_num_heads * (cfg.qk_head_dim + 2 * cfg.v_head_dim) * act
    experts = cfg.num_experts_per_token * (2 * cfg.routed_expert_hidden_size + 3 * cfg.moe_intermediate_size) * act
    return stream + max(kda, mla) + experts + 4 * cfg.hidden_size * act


def default_chunk_size(cfg: K3Config, batch: int, memory_bytes: int | None) -> int | None:
    """The prefill chunk for `batch` rows on a device of `memory_bytes` (None: whole prompt)."""
    if memory_bytes is None:
        return None
    budget = memory_bytes // ACTIVATION_SHARE // (batch * activation_bytes_per_token(cfg))
    chunk = MIN_CHUNK
    while chunk * 2 <= min(budget, MAX_CHUNK):
        chunk *= 2
    return chunk


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """The memory limit the device reports (GPU, TPU), or None where it reports none (CPU)."""
    stats = (device or jax.local_devices()[0]).memory_stats()
    return stats.get("bytes_limit") if stats else None
