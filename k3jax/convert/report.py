"""`--plan-only`: the conversion plan as a table — target leaf, shape, dtype, bytes, transform, sources —
and, for a mesh, the parameter bytes each device would hold.

Stacked experts list their sources as one pattern (`experts.{0..895}.w1.weight_{packed,scale}`)
rather than one line per expert, so the table stays one line per written leaf.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np

from k3jax.checkpoint.names import path_names
from k3jax.checkpoint.release_plan import LeafPlan, ReleasePlan
from k3jax.load.placement import check_mesh, leaf_shardings
from k3jax.model import K3Model
from k3jax.units import format_bytes
from sharding import abstract_mesh


def _sources(leaf: LeafPlan) -> str:
    first = leaf.parts[0]
    if leaf.kind in ("mxfp4_packed", "mxfp4_scale"):
        shown = first[0 if leaf.kind == "mxfp4_packed" else 1]
    elif len(first) == 2:
        shown = re.sub(r"_packed$", "_{packed,scale}", first[0])
    else:
        shown = first[0]
    if leaf.kind in ("experts", "mxfp4_packed", "mxfp4_scale"):
        shown = re.sub(r"\.experts\.0\.", f".experts.{{0..{len(leaf.parts) - 1}}}.", shown)
    return shown


def format_release_plan(plan: ReleasePlan) -> str:
    """One row per written leaf, then the item count, the largest item and the bytes written and read."""
    rows = [("item", "leaf", "shape", "dtype", "bytes", "transform", "source")]
    for item in plan.items:
        for leaf in item.leaves:
            rows.append((item.name, leaf.target, "x".join(map(str, leaf.shape)) or "scalar", leaf.dtype.name,
                         str(leaf.nbytes), leaf.transform, _sources(leaf)))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = ["  ".join(cell.ljust(w) if i != 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             + "  " + row[6] for row in rows]
    largest = max(plan.items, key=lambda item: item.nbytes)
    lines.append("")
    lines.append(f"items: {len(plan.items)}, leaves: {sum(len(i.leaves) for i in plan.items)}, "
                 f"largest item: {largest.name} ({format_bytes(largest.nbytes)})")
    lines.append(f"total: {plan.nbytes} bytes written ({format_bytes(plan.nbytes)}) "
                 f"from {plan.source_bytes} bytes read ({format_bytes(plan.source_bytes)})")
    return "\n".join(lines)


def device_bytes(abstract: K3Model, mesh_spec: str, num_devices: int | None = None) -> dict:
    """Parameter bytes each device holds when `abstract` is placed on mesh `mesh_spec` by DEFAULT_RULES.

    Needs no devices: the mesh is an `AbstractMesh` of the spec's sizes (a spec with -1 takes the size
    from `num_devices`, default the local device count), and every leaf is split by the sharding
    `sharding.param_shardings` gives it, exactly as a load onto that mesh places it. Returns totals and
    the largest leaves per device.
    """
    mesh = abstract_mesh(mesh_spec, num_devices)
    check_mesh(abstract.config, mesh)  # a mesh no load can use has no bytes per device to report
    shardings = leaf_shardings(abstract, mesh)
    per_device, total, split, leaves = 0, 0, 0, []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        sharding = shardings[jax.tree_util.keystr(key_path)]
        shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
        shard = tuple(sharding.shard_shape(shape))
        nbytes = math.prod(shard) * itemsize
        per_device += nbytes
        total += math.prod(shape) * itemsize
        split += shard != shape
        leaves.append((nbytes, ".".join(map(str, path_names(key_path))), shape, shard, tuple(sharding.spec)))
    leaves.sort(reverse=True)
    return {"mesh": dict(mesh.shape), "devices": mesh.size, "per_device": per_device, "total": total,
            "leaves": len(leaves), "split": split, "largest": leaves[:5]}


def format_device_bytes(report: dict) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in report["mesh"].items() if v > 1) or "1 device"
    lines = [f"mesh {mesh} ({report['devices']} devices): {report['per_device']} bytes "
             f"({format_bytes(report['per_device'])}) of parameters per device, of {report['total']} bytes "
             f"({format_bytes(report['total'])}) in all; {report['split']} of {report['leaves']} leaves split"]
    for nbytes, path, shape, shard, spec in report["largest"]:
        lines.append(f"  {format_bytes(nbytes):>10} per device  {path}  {'x'.join(map(str, shape))} -> "
                     f"{'x'.join(map(str, shard))}  {spec}")
    return "\n".join(lines)
