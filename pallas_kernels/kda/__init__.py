"""KDA (Kimi Delta Attention): public entry points and pure-JAX references."""

from pallas_kernels.kda.api import chunk_kda, kda_decode
from pallas_kernels.kda.reference import naive_recurrent_kda, recurrent_kda_step

__all__ = ["chunk_kda", "kda_decode", "naive_recurrent_kda", "recurrent_kda_step"]
