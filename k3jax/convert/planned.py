"""`plan_conversion`: everything a conversion knows before it reads any tensor data.

The config, the shard headers and the full leaf table checked against the abstract model, so a
broken release fails before anything is written; and the settings a resumed run must agree on.
Routed experts: `experts="mxfp4"` keeps the release's packed codes and scales (4.25 bits per
weight; the model decodes them on the fly), `experts="bf16"` decodes them to bfloat16 at
conversion, None picks "mxfp4" for a release whose experts are all MXFP4 and the model dtype
otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from k3jax.checkpoint.release_plan import ReleasePlan, build_plan, source_experts_are_mxfp4, text_only_without_vision
from k3jax.checkpoint.safetensors_index import CheckpointIndex
from k3jax.config import K3Config
from k3jax.load.abstract import abstract_model
from k3jax.model import K3Model

DTYPES = ("bfloat16", "float32")
EXPERT_FORMATS = ("mxfp4", "bf16")


@dataclasses.dataclass(frozen=True)
class PlannedConversion:
    """Everything known before any tensor data is read."""

    hf_dir: Path
    index: CheckpointIndex
    abstract: K3Model
    plan: ReleasePlan
    settings: dict  # what a resumed run must agree on


def plan_conversion(hf_dir: str | Path, *, dtype: str = "bfloat16", experts: str | None = None) -> PlannedConversion:
    """Read config and shard headers and check the full leaf table against the abstract model."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {DTYPES}")
    if experts is not None and experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r}: expected one of {EXPERT_FORMATS} or None")
    hf_dir = Path(hf_dir).absolute()
    index = CheckpointIndex.open(hf_dir)
    cfg = text_only_without_vision(K3Config.from_hf(hf_dir, dtype=dtype), index)
    if experts is None and source_experts_are_mxfp4(index):
        experts = "mxfp4"
    abstract = abstract_model(cfg, packed_experts=experts == "mxfp4")
    plan = build_plan(index, abstract, experts_dtype="bfloat16" if experts == "bf16" else None)
    settings = {
        "dtype": dtype, "experts": experts, "plan_fingerprint": plan.fingerprint,
        "config_sha256": hashlib.sha256((hf_dir / "config.json").read_bytes()).hexdigest(),
    }
    return PlannedConversion(hf_dir, index, abstract, plan, settings)
