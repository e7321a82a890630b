"""HF release -> per-layer Orbax checkpoint conversion (the directory's format: `k3jax.checkpoint.store`).

    k3jax.convert.convert("Kimi-K3", "Kimi-K3-orbax", dtype="bfloat16", verify=True)
    model = k3jax.from_pretrained("Kimi-K3-orbax")   # detects the converted layout

Planned from headers first (`planned`), written by one process (`converter`) or by every process of
a mesh, each its own slices (`sharded`), into an output directory that resumes after a kill and
is verified on request (`output`, `verify`); `--plan-only` prints `report`. The release's config,
tokenizer and generation files are copied beside the items (`text_files`), so the output loads and
tokenizes on its own.
"""

from k3jax.convert.converter import convert
from k3jax.convert.output import ConvertResult
from k3jax.convert.planned import PlannedConversion, plan_conversion

__all__ = ["ConvertResult", "PlannedConversion", "convert", "plan_conversion"]
