"""`make_mesh`: one device mesh with the five k3jax axes, built from a short string like "expert=4,tensor=2".

Every mesh has all of MESH_AXES, unspecified ones of size 1, so the rule table (rules.py) can name any
axis without caring which parallelism a run uses. Axis order sets device placement: `jax.make_mesh`
gives the *last* axes the most closely connected devices, so `tensor` (a collective after every
sharded matmul) is innermost and `data` (no collectives in inference) outermost.

Axes are `AxisType.Auto` (GSPMD propagation): the model code carries no sharding annotations, so
JAX 0.9+'s default Explicit axes would reject its ambiguous einsums (jax-ecosystem.md §6).
The mesh spans `jax.devices()`, i.e. every process's devices; multi-host runs call
`jax.distributed.initialize()` first. (`jax.make_mesh` refuses multi-slice TPU topologies; those
need `mesh_utils.create_hybrid_device_mesh`, not handled here.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")

# No argument: shard the weights FSDP-style over every device. `embed` is on nearly every weight, so
# this is the one layout that spreads memory on any device count without choosing a parallelism.
DEFAULT_SPEC = "fsdp=-1"


def _axis_sizes(spec: str) -> dict[str, int]:
    """The sizes a spec names, checked part by part: "data=2,tensor=-1" -> {"data": 2, "tensor": -1}."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"mesh spec {spec!r}: part {part!r} is not of the form axis=size")
        if name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r} in {part!r}; axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: size {value!r} of axis {name!r} is not an integer") from None
        if size < 1 and size != -1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} has size {size}; sizes are >= 1, or -1 for the rest")
        sizes[name] = size
    return sizes


def parse_mesh_spec(spec: str, num_devices: int) -> dict[str, int]:
    """"data=2,tensor=-1" -> {"data": 2, "fsdp": 1, ..., "tensor": num_devices // 2}, checked."""
    sizes = _axis_sizes(spec)
    auto = [name for name, size in sizes.items() if size == -1]
    if len(auto) > 1:
        raise ValueError(f"mesh spec {spec!r}: only one axis may be -1, got {', '.join(auto)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if auto:
        if num_devices % fixed:
            raise ValueError(
                f"mesh spec {spec!r}: the fixed axes use {fixed} devices, which does not divide the "
                f"{num_devices} devices, so {auto[0]}=-1 cannot absorb the rest"
            )
        sizes[auto[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh spec {spec!r}: axis sizes multiply to {fixed}, but there are {num_devices} devices")
    return {name: sizes.get(name, 1) for name in MESH_AXES}


def mesh_device_count(spec: str) -> int:
    """Devices a spec of explicit sizes spans ("expert=8,tensor=4" -> 32), for planning a mesh that
    need not exist here; -1 ("the rest") has no meaning without devices, so it is an error."""
    sizes = _axis_sizes(spec)
    auto = [name for name, size in sizes.items() if size == -1]
    if auto:
        raise ValueError(f"mesh spec {spec!r}: axis {auto[0]!r} has size -1; a device count needs explicit sizes")
    return math.prod(sizes.values())


def make_mesh(spec: str | Mesh | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over `devices` (default: all processes' devices) with axes MESH_AXES.

    `spec` is "axis=size,..." (one size may be -1), an existing Mesh (returned as is, after checking
    its axis names), or None for DEFAULT_SPEC.
    """
    if isinstance(spec, Mesh):
        missing = [a for a in MESH_AXES if a not in spec.axis_names]
        if missing:
            raise ValueError(f"mesh has axes {spec.axis_names}; the rules need all of {MESH_AXES} (missing {missing})")
        return spec
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"mesh spec must be a string, a Mesh or None; got {type(spec).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(DEFAULT_SPEC if spec is None else spec, len(devices))
    return jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def abstract_mesh(spec: str, num_devices: int | None = None) -> AbstractMesh:
    """The mesh `spec` describes, without devices (for planning and for shardings computed before any
    device is touched): explicit sizes, or a -1 axis that takes the rest of `num_devices` (default:
    this process's device count)."""
    sizes = _axis_sizes(spec)
    if -1 in sizes.values():
        count = jax.device_count() if num_devices is None else num_devices
    else:
        count = math.prod(sizes.values())
    full = parse_mesh_spec(spec, count)
    return AbstractMesh(tuple(full[axis] for axis in MESH_AXES), MESH_AXES)
