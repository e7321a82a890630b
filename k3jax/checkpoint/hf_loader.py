"""Load a Hugging Face K3 release directory into a K3Model.

The name map and the transforms (stacked routed experts with MXFP4 decode, the padded `A_log`,
casts) live in `k3jax.convert.plan` / `k3jax.convert.transform`, shared with the Orbax converter:
the whole plan is checked against the checkpoint's headers first, so anything missing, unexpected
or mis-shaped is an error naming the tensor before any tensor data is read.
"""

from __future__ import annotations

from pathlib import Path

from k3jax.checkpoint.safetensors_index import CheckpointIndex
from k3jax.config import K3Config
from k3jax.convert.assemble import assemble_model
from k3jax.convert.plan import abstract_model, build_plan
from k3jax.convert.transform import materialize
from k3jax.model import K3Model


def load_hf_model(
    path: str | Path, *, dtype: str = "bfloat16", moe_implementation: str = "auto", experts: str | None = None
) -> K3Model:
    """Build a K3Model from an HF release directory (config.json + safetensors index and shards).

    Routed experts are decoded into the model dtype (`experts` None or "bf16"), or with "mxfp4" kept
    as the release's packed codes and scales, which the model decodes on the fly."""
    if experts not in (None, "mxfp4", "bf16"):
        raise ValueError(f"experts={experts!r}: expected 'mxfp4', 'bf16' or None")
    cfg = K3Config.from_hf(path, dtype=dtype)
    index = CheckpointIndex.open(path)
    abstract = abstract_model(cfg, packed_experts=experts == "mxfp4", moe_implementation=moe_implementation)
    plan = build_plan(index, abstract)
    return assemble_model(abstract, lambda item, target: materialize(plan.item(item).leaf(target), index))
