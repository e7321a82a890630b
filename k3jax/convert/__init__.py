"""HF release -> per-layer Orbax checkpoint conversion, and loading of converted directories.

    k3jax.convert.convert("Kimi-K3", "Kimi-K3-orbax", dtype="bfloat16", verify=True)
    model = k3jax.from_pretrained("Kimi-K3-orbax")   # detects the converted layout
"""

from k3jax.convert.converter import ConvertResult, convert, plan_conversion
from k3jax.convert.load import load_converted
from k3jax.convert.store import is_converted

__all__ = ["ConvertResult", "convert", "is_converted", "load_converted", "plan_conversion"]
