"""Load a Hugging Face K3 release directory into a K3Model.

The whole plan (`checkpoint.release_plan`: names, stacked routed experts with MXFP4 decode, the padded
`A_log`, casts) is checked against the checkpoint's headers first, so anything missing, unexpected
or mis-shaped is an error naming the tensor before any tensor data is read. Each item is then made
by the one transform the converter also uses: whole on the host (`materialize_item`), or on a mesh
as global arrays whose devices read only their own slices of the release (`region.leaf_array`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3jax.checkpoint.names import Slot
from k3jax.checkpoint.release_plan import build_plan, text_only_without_vision
from k3jax.checkpoint.region import leaf_array
from k3jax.checkpoint.safetensors_index import CheckpointIndex
from k3jax.checkpoint.transform import materialize_item
from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.load.abstract import abstract_model
from k3jax.load.assemble import load_model
from k3jax.model import K3Model
from sharding import make_mesh

EXPERTS = (None, "mxfp4", "bf16")


def load_hf_model(
    path: str | Path, *, dtype: str = "bfloat16", experts: str | None = None,
    kernels: Kernels | Mapping[str, str | None] | None = None, mesh: str | Mesh | None = None,
) -> K3Model:
    """Build a K3Model from an HF release directory (config.json + safetensors index and shards).

    Routed experts are decoded into the model dtype (`experts` None or "bf16"), or with "mxfp4" kept
    as the release's packed codes and scales, which the model decodes on the fly. `mesh` (a spec such
    as "expert=8,tensor=8", or a Mesh) places every leaf by `sharding.DEFAULT_RULES` as it is read."""
    if experts not in EXPERTS:
        raise ValueError(f"experts={experts!r}: expected one of {EXPERTS}")
    path = Path(path).absolute()
    index = CheckpointIndex.open(path)
    cfg = text_only_without_vision(K3Config.from_hf(path, dtype=dtype), index)
    return release_model(index, cfg, packed_experts=experts == "mxfp4", kernels=kernels,
                         mesh=None if mesh is None else make_mesh(mesh))


def release_model(
    index: CheckpointIndex, cfg: K3Config, *, packed_experts: bool = False,
    kernels: Kernels | Mapping[str, str | None] | None = None, mesh: Mesh | None = None,
) -> K3Model:
    """The model `index` holds, in `cfg`'s dtype (`cfg` already read from the release's config)."""
    abstract = abstract_model(cfg, packed_experts=packed_experts, kernels=kernels)
    plan = build_plan(index, abstract)

    def read_item(item: str, slots: dict[Slot, jax.ShapeDtypeStruct],
                  shardings: dict[str, NamedSharding] | None) -> dict[str, np.ndarray | jax.Array]:
        if shardings is None:
            return materialize_item(plan.item(item), index)
        return {leaf.target: leaf_array(leaf, index, shardings[leaf.target]) for leaf in plan.item(item).leaves}

    return load_model(abstract, read_item, mesh)
