"""The abstract sharded state the planned inference programs run on: parameters and caches.

Every leaf is a ShapeDtypeStruct carrying the NamedSharding the `sharding` package gives it on the
mesh, so lowering partitions the programs exactly as a real run would, with nothing allocated.
Parameter and cache bytes per device follow from these shardings alone (`state_bytes`),
exactly and at full depth.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from k3jax.config import K3Config
from k3jax.kernels import Kernels
from k3jax.load.abstract import abstract_model
from sharding import cache_shardings, param_shardings


def sharded_leaves(tree: Any, prefix_shardings: Any) -> tuple[list[jax.ShapeDtypeStruct], Any]:
    """Flat ShapeDtypeStructs of `tree` with the shardings of `prefix_shardings` (a prefix tree, as
    `sharding.param_shardings` / `cache_shardings` return) attached, plus the treedef to rebuild `tree`."""
    full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix_shardings, tree)
    leaves, treedef = jax.tree.flatten(tree)
    shardings = jax.tree.leaves(full)
    if len(leaves) != len(shardings):
        raise ValueError(f"the shardings tree has {len(shardings)} leaves, the tree it places {len(leaves)}")
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shardings)], treedef


def shard_bytes(leaves: list[jax.ShapeDtypeStruct]) -> int:
    """Bytes one device holds of sharded ShapeDtypeStructs (the largest shard: uneven splits round up)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


def total_bytes(leaves: list[jax.ShapeDtypeStruct]) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)


@dataclasses.dataclass(frozen=True)
class AbstractState:
    """The model's parameters and an empty cache as sharded leaves, with the treedefs to rebuild them."""

    params: list[jax.ShapeDtypeStruct]
    model_def: Any
    caches: list[jax.ShapeDtypeStruct]
    cache_def: Any


def abstract_state(cfg: K3Config, mesh: Mesh, *, experts: str, batch: int, max_len: int,
                   kernels: Kernels) -> AbstractState:
    """The model (routed experts "mxfp4"-packed or "bf16") and a cache of `batch` x `max_len` tokens."""
    model = abstract_model(cfg, packed_experts=experts == "mxfp4", kernels=kernels)
    params, model_def = sharded_leaves(model, param_shardings(model, mesh))
    cache = jax.eval_shape(lambda: model.empty_cache(batch, max_len))
    caches, cache_def = sharded_leaves(cache, cache_shardings(cache, mesh))
    return AbstractState(params, model_def, caches, cache_def)


def state_bytes(cfg: K3Config, mesh: Mesh, *, experts: str, batch: int, max_len: int,
                kernels: Kernels) -> dict[str, int]:
    """Exact per-device (and total) parameter / cache bytes of the full-depth model."""
    state = abstract_state(cfg, mesh, experts=experts, batch=batch, max_len=max_len, kernels=kernels)
    return {"params": shard_bytes(state.params), "params_total": total_bytes(state.params),
            "cache": shard_bytes(state.caches), "cache_total": total_bytes(state.caches)}
