"""MLA prefill attention: per-head keys/values expanded from the cached latents, attended causally
without [T, S] scores in memory; and the absorbed-form decode attention as mergeable partials over key
ranges (``absorbed.py``; the math of context-parallel decode).

``mla_prefill_attention`` takes ``implementation`` ("cudnn", "cudnn_chunk", "cudnn_masked", "xla" or
None for the policy; see ``dispatch.py``); ``attention_mask`` is the one definition of which keys a
query sees, shared with the model's absorbed decode step.
"""

from pallas_kernels.mla.absorbed import Partial, absorbed_attention, absorbed_partial, merge_partials
from pallas_kernels.mla.api import mla_prefill_attention
from pallas_kernels.mla.cudnn import cudnn_mla_attention
from pallas_kernels.mla.cudnn_chunk import cudnn_chunk_mla_attention
from pallas_kernels.mla.dispatch import IMPLEMENTATIONS
from pallas_kernels.mla.reference import (
    attention_mask, blockwise_mla_attention, expand_keys_values, naive_mla_attention,
)

__all__ = [
    "IMPLEMENTATIONS", "Partial", "absorbed_attention", "absorbed_partial", "attention_mask", "blockwise_mla_attention",
    "cudnn_chunk_mla_attention", "cudnn_mla_attention", "expand_keys_values", "merge_partials", "mla_prefill_attention",
    "naive_mla_attention",
]
