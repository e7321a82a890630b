"""Place a K3Model, its cache and its inputs on a mesh, from each array's logical axes and one rule table.

The model is a pytree (Flax NNX, tree-clean), so a sharded model is just the same tree with sharded
leaves: `jax.jit` (used by `forward`, `prefill`, `decode_step`, `generate`) reads the input shardings
and GSPMD partitions the whole program from them. No model code changes, no `jax.set_mesh` needed.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.model import K3Model, ModelCache
from k3jax.nn.kda import KDACache
from k3jax.nn.mla import MLACache
from k3jax.nn.moe import LatentMoE
from sharding.rules import DEFAULT_RULES, Rules, logical_to_spec

# Logical axes of the cache arrays (the model's parameters declare theirs in the model code). They
# are the layouts GSPMD itself gives the caches that prefill/decode_step return, so a decode step's
# output cache has its input's layout: no recompile on the second step, and donation can reuse the
# buffers. The KDA state's heads follow `kda_heads` (split like the projections that update them);
# the conv tail [B, W-1, 3P] holds the q|k|v projections' last inputs, split along 3P like them.
CACHE_AXES: dict[type, dict[str, tuple[str | None, ...]]] = {
    KDACache: {
        "state": ("activation_batch", "kda_heads", None, None),
        "conv": ("activation_batch", None, "kda_proj"),
    },
    MLACache: {"latent": ("activation_batch", "cache_length", None)},
}


def _is_variable(x: object) -> bool:
    return isinstance(x, nnx.Variable)


def named_sharding(
    logical_axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules: Rules
) -> NamedSharding:
    """NamedSharding for one array. Extra leading dims (the stacked `layers` axis of scanned groups,
    which the per-layer declaration does not know about) are named "layers"."""
    extra = len(shape) - len(logical_axes)
    if extra < 0:
        raise ValueError(f"logical axes {logical_axes} have more entries than shape {shape}")
    return NamedSharding(mesh, logical_to_spec(("layers",) * extra + tuple(logical_axes), rules, mesh, shape))


def param_shardings(model: K3Model, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> K3Model:
    """The model's tree with a NamedSharding in place of every Variable (a prefix of the model's pytree,
    as `jax.device_put` and `jax.jit(in_shardings=...)` accept). Params must declare `logical_axes`."""

    def sharding_of(path, leaf):
        if not _is_variable(leaf):  # a plain array attribute: nothing declares it, keep it whole
            return NamedSharding(mesh, PartitionSpec())
        axes = leaf.get_metadata().get("logical_axes")
        if axes is None:
            if isinstance(leaf, nnx.Param):
                raise ValueError(f"parameter {jax.tree_util.keystr(path)} declares no logical_axes")
            return NamedSharding(mesh, PartitionSpec())
        try:
            return named_sharding(axes, leaf.shape, mesh, rules)
        except (KeyError, ValueError) as e:
            raise type(e)(f"parameter {jax.tree_util.keystr(path)}: {e}") from None

    return jax.tree_util.tree_map_with_path(sharding_of, model, is_leaf=_is_variable)


def shard_model(model: K3Model, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> K3Model:
    """The model with every parameter placed on `mesh` by `rules` (a new tree; `model` is unchanged).

    When `exp` lands on a mesh axis of size > 1, the MoE layers are told the mesh, so their routed
    experts run expert-parallel under shard_map rather than as a GSPMD-partitioned ragged_dot."""
    sharded = jax.device_put(model, param_shardings(model, mesh, rules))
    enable_expert_parallelism(sharded, mesh, rules)
    return sharded


def enable_expert_parallelism(model: K3Model, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
    """Give every LatentMoE the mesh if experts are split over it (in place; static attributes)."""
    expert_axis = rules.get("exp")
    if expert_axis is None or not isinstance(expert_axis, str) or mesh.shape.get(expert_axis, 1) == 1:
        return
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LatentMoE):
            module.expert_mesh = mesh


def cache_shardings(cache: ModelCache, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> ModelCache:
    """NamedShardings for a ModelCache (see CACHE_AXES): batch on (data, fsdp), KDA heads and conv
    channels on tensor; group caches carry a leading stacked-layer axis; the token count is replicated."""

    def layer(cache_entry, stacked: bool):
        axes = CACHE_AXES[type(cache_entry)]
        return type(cache_entry)(**{
            field: named_sharding(("layers",) * stacked + axes[field], getattr(cache_entry, field).shape, mesh, rules)
            for field in cache_entry._fields
        })

    return ModelCache(
        head=tuple(layer(c, False) for c in cache.head),
        groups=tuple(layer(c, True) for c in cache.groups),
        tail=tuple(layer(c, False) for c in cache.tail),
        length=NamedSharding(mesh, PartitionSpec()),
        start=None if cache.start is None else named_sharding(("activation_batch",), cache.start.shape, mesh, rules),
    )


def shard_cache(cache: ModelCache, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> ModelCache:
    return jax.device_put(cache, cache_shardings(cache, mesh, rules))


def shard_batch(input_ids: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> jax.Array:
    """Token ids [B, T] split over the batch axes, so jitted calls start data-parallel."""
    return jax.device_put(input_ids, named_sharding(("activation_batch", None), input_ids.shape, mesh, rules))
