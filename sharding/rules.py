"""The one sharding table: logical axis name -> mesh axis, and its translation to a PartitionSpec.

Every parameter declares logical axes (k3jax/nn/layers.py `declare`); caches and inputs use the
`activation_*` / `cache_*` names below. Trying another parallelism layout means editing (or copying
with overrides, `{**DEFAULT_RULES, "exp": ("expert", "fsdp")}`) this one table, nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from jax.sharding import Mesh, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

DEFAULT_RULES: Rules = MappingProxyType({
    # Model width, on nearly every weight: FSDP-style, each weight is all-gathered where it is used,
    # so `fsdp` spreads memory without choosing a per-layer scheme.
    "embed": "fsdp",
    # Embedding rows and lm_head outputs: Megatron vocab parallelism (logits come out vocab-split).
    "vocab": "tensor",
    # Head-aligned projection widths (H * head_dim) of KDA and MLA, and KDA per-head vectors:
    # tensor (head) parallelism, so q/k/v/gate columns and o_proj rows split together and a layer
    # needs one all-reduce after o_proj. KDA heads must follow the same axis as the projections.
    "kda_proj": "tensor",
    "kda_heads": "tensor",
    "mla_proj": "tensor",
    # MLA low-rank bottlenecks (q_lora 1536-like, kv_lora 512-like): small, and splitting them would
    # add an all-reduce between the down- and up-projection, for little memory. Replicated.
    "q_lora": None,
    "kv_lora": None,
    # Dense / shared-expert FFN width: Megatron MLP (gate/up column-split, down row-split).
    "mlp": "tensor",
    # Routed experts: expert parallelism; the expert FFN width additionally on tensor, so a mesh with
    # both axes holds E/ep experts x F/tp per device (jax-ecosystem.md §7.2).
    "exp": "expert",
    "mlp_moe": "tensor",
    # The latent expert width: small, and routed_expert_{down,up}_proj pair it with `embed` in one
    # weight, so it cannot also take `fsdp`. Replicated.
    "embed_moe": None,
    # Inputs and caches: batch is data-parallel over data and fsdp (fsdp replicas differ only in
    # which weight shards they hold, so they can take different sequences).
    "activation_batch": ("data", "fsdp"),
    # The MLA cache's sequence axis: context parallelism. At batch 1 nothing else splits the latent
    # cache (29 GB at 1M tokens for K3), so `context` devices each hold 1/context of the positions;
    # decode attends per shard under shard_map and merges with one all-gather (context_parallel.py),
    # GSPMD partitions prefill's attention.
    "cache_length": "context",
    # The stacked layer axis of scanned groups: never split (each scan step needs its whole layer).
    "layers": None,
})


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _check_collisions(logical_axes: Sequence[str | None], rules: Rules) -> None:
    """Two dims of one array on the same mesh axis is never valid; this is a rule-table bug, so it is
    checked on the logical names, independent of mesh sizes (a laptop run catches what a pod would)."""
    owner: dict[str, str] = {}
    for name in logical_axes:
        if name is None:
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no entry in the sharding rules (known: {sorted(rules)})")
        for mesh_axis in _as_tuple(rules[name]):
            if mesh_axis in owner and owner[mesh_axis] != name:
                raise ValueError(
                    f"logical axes {owner[mesh_axis]!r} and {name!r} of {tuple(logical_axes)} both map to "
                    f"mesh axis {mesh_axis!r}"
                )
            if mesh_axis in owner:
                raise ValueError(f"logical axis {name!r} appears twice in {tuple(logical_axes)}")
            owner[mesh_axis] = name


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Logical names of an array's dims -> PartitionSpec on `mesh`.

    Per dim, mesh axes of size 1 are dropped (a no-op, and the spec stays readable). With `shape`,
    a dim keeps only the longest prefix of its mesh axes whose product divides the dim, falling back
    to replication: GSPMD needs even shards, and tiny test configs have dims such as 4 heads or a
    batch of 1 that a larger mesh axis cannot split. This is a silent layout choice, never a change
    in results; `param_shardings` tests still assert that something is split.
    """
    _check_collisions(logical_axes, rules)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    for name in logical_axes:
        for mesh_axis in _as_tuple(rules[name]) if name is not None else ():
            if mesh_axis not in mesh.shape:
                raise ValueError(f"rule {name!r} -> {mesh_axis!r}: no such axis in the mesh {mesh.axis_names}")
    entries: list[MeshAxes] = []
    for dim, name in enumerate(logical_axes):
        axes = [a for a in (_as_tuple(rules[name]) if name is not None else ()) if mesh.shape[a] > 1]
        if shape is not None:
            while axes and shape[dim] % math.prod(mesh.shape[a] for a in axes):
                axes.pop()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)
