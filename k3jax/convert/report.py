"""`--plan-only`: the conversion plan as a table — target leaf, shape, dtype, bytes, transform, sources.

Stacked experts list their sources as one pattern (`experts.{0..895}.w1.weight_{packed,scale}`)
rather than one line per expert, so the table stays one line per written leaf.
"""

from __future__ import annotations

import math
import re

import numpy as np

from k3jax.convert.plan import ConversionPlan, LeafPlan


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exp:.1f} {'KMGT'[exp - 1]}iB"


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


def format_plan(plan: ConversionPlan) -> str:
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
                 f"largest item: {largest.name} ({human_bytes(largest.nbytes)})")
    lines.append(f"total: {plan.nbytes} bytes written ({human_bytes(plan.nbytes)}) "
                 f"from {plan.source_bytes} bytes read ({human_bytes(plan.source_bytes)})")
    return "\n".join(lines)


def device_bytes(abstract, mesh_spec: str, num_devices: int | None = None) -> dict:
    """Parameter bytes each device holds when `abstract` is placed on mesh `mesh_spec` by DEFAULT_RULES.

    Needs no devices: the mesh is an `AbstractMesh` of the spec's sizes (a spec with -1 takes the size
    from `num_devices`, default the local device count). Every leaf's split follows
    `sharding.logical_to_spec` on its declared logical axes, exactly as `param_shardings` would place it.
    Returns totals and the largest leaves per device.
    """
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from jax.sharding import AbstractMesh  # noqa: PLC0415

    from sharding import DEFAULT_RULES, MESH_AXES, logical_to_spec  # noqa: PLC0415
    from sharding.mesh import parse_mesh_spec  # noqa: PLC0415

    if num_devices is None:
        parts = [p.partition("=")[2].strip() for p in mesh_spec.split(",")]
        num_devices = (math.prod(int(p) for p in parts if p.lstrip("-").isdigit() and int(p) > 0)
                       if "-1" not in parts else len(jax.devices()))
    sizes = parse_mesh_spec(mesh_spec, num_devices)
    mesh = AbstractMesh(tuple(sizes.values()), MESH_AXES)
    per_device, total, split, leaves = 0, 0, 0, []
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    for key_path, var in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_variable)[0]:
        shape, itemsize = tuple(var.shape), np.dtype(var.dtype).itemsize
        axes = tuple(var.get_metadata().get("logical_axes") or (None,) * len(shape))
        axes = ("layers",) * (len(shape) - len(axes)) + axes
        spec = tuple(logical_to_spec(axes, DEFAULT_RULES, mesh, shape))
        shard = list(shape)
        for d, entry in enumerate(spec):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                shard[d] //= sizes[axis]
        nbytes = math.prod(shard) * itemsize
        per_device += nbytes
        total += math.prod(shape) * itemsize
        split += tuple(shard) != shape
        leaves.append((nbytes, jax.tree_util.keystr(key_path), shape, tuple(shard), spec))
    leaves.sort(reverse=True)
    return {"mesh": sizes, "devices": num_devices, "per_device": per_device, "total": total,
            "leaves": len(leaves), "split": split, "largest": leaves[:5]}


def format_device_bytes(report: dict) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in report["mesh"].items() if v > 1) or "1 device"
    lines = [f"mesh {mesh} ({report['devices']} devices): {report['per_device']} bytes "
             f"({human_bytes(report['per_device'])}) of parameters per device, of {report['total']} bytes "
             f"({human_bytes(report['total'])}) in all; {report['split']} of {report['leaves']} leaves split"]
    for nbytes, path, shape, shard, spec in report["largest"]:
        lines.append(f"  {human_bytes(nbytes):>10} per device  {path}  {'x'.join(map(str, shape))} -> "
                     f"{'x'.join(map(str, shard))}  {spec}")
    return "\n".join(lines)
