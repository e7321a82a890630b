"""KDA (Kimi Delta Attention): the public ops and the pure-JAX references.

``chunk_kda`` (pre-activated inputs), ``chunk_kda_fused`` (K3's raw inputs, activations
included) and ``kda_decode`` take ``implementation`` ("xla", "pallas_gpu", "mosaic_tpu" or None
for the policy; see ``dispatch.py``).
"""

from pallas_kernels.kda.api import chunk_kda, chunk_kda_fused, kda_decode
from pallas_kernels.kda.dispatch import CHUNK_IMPLEMENTATIONS, DECODE_IMPLEMENTATIONS
from pallas_kernels.kda.reference import (
    L2_NORM_EPS, activate, chunked_kda, naive_recurrent_kda, recurrent_kda_step,
)

__all__ = [
    "CHUNK_IMPLEMENTATIONS", "DECODE_IMPLEMENTATIONS", "L2_NORM_EPS", "activate", "chunk_kda",
    "chunk_kda_fused", "chunked_kda", "kda_decode", "naive_recurrent_kda", "recurrent_kda_step",
]
