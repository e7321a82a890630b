"""k3jax: Kimi K3 in JAX / Flax NNX.

    model = k3jax.from_pretrained("path/to/Kimi-K3", dtype="bfloat16")
    logits = model(input_ids)                     # int32 [B, T] -> float32 [B, T, vocab]
    new_ids = k3jax.generate(model, input_ids, max_new_tokens=32)

The kernel each op runs is part of the model (`K3Model.init(cfg, kernels=k3jax.Kernels(moe="xla"))`;
None: the dispatch policy for this platform).
"""

from importlib.metadata import PackageNotFoundError, version

from k3jax.config import ConfigError, K3Config
from k3jax.generate import GenerateOutput, decode_step, extend, generate, left_pad, prefill
from k3jax.kernels import Kernels
from k3jax.model import K3Model, ModelCache, forward
from k3jax.pretrained import from_pretrained

try:
    __version__ = version("k3jax")
except PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "ConfigError", "GenerateOutput", "K3Config", "K3Model", "Kernels", "ModelCache", "decode_step", "forward",
    "extend", "from_pretrained", "generate", "left_pad", "prefill",
]
