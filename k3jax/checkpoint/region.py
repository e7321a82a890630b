"""One device's region of a planned leaf, reading only the source bytes that region needs.

    box = read_box_of(leaf, region)
    piece = in_box(read_box(leaf, index, box), leaf, box, region)   # == materialize(leaf, index)[region]
    array = leaf_array(leaf, index, sharding)   # a global jax.Array: each device reads its own region

A piece equals `materialize(leaf, index)[region]` bit for bit because `read_box` *is* `materialize`:
it runs the one transform (MXFP4 decode or keep, stacking, A_log slicing, cast, NaN/inf check) on a
smaller leaf whose sources are row ranges of the release's tensors. A row range of a row-major
tensor is one contiguous byte range, so it is described by an ordinary `TensorInfo` (same file,
narrower offsets) and read by the ordinary reader.

What is read for a region (its "read box"):
* a stacked expert leaf [E, rows, cols]: only the tensors of the experts in the region, and of those
  only the region's rows (the release's rows: `out` of each expert's [out, in] weight, packed codes
  or scales);
* any other leaf of rank >= 2: only the region's rows of its leading dimension;
* inner dimensions (columns, and anything after the rows) are always read whole and sliced in memory.
  A leaf split along an inner dimension therefore reads full rows; `read_box` is what callers cache,
  so the devices of one process that share a read box (e.g. the `tensor` halves of a `w2` expert
  weight, split along its last axis) read it once between them;
* vectors (rank <= 1: norms, biases, A_log) are read whole: they are kilobytes, and A_log's check that
  its padding is zero needs the whole stored vector.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from k3jax.checkpoint.release_plan import LeafPlan
from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex, TensorInfo
from k3jax.checkpoint.transform import materialize

STACKED_KINDS = ("experts", "mxfp4_packed", "mxfp4_scale")

Box = tuple[tuple[int, int], ...]  # (start, stop) of the leading dimensions a read selects


def bounds(region: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension of a region given as slices (as jax passes shard indices)."""
    if len(region) != len(shape):
        raise ValueError(f"region {region} does not match leaf shape {shape}")
    out = []
    for s, n in zip(region, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"region {region} of shape {shape}: only contiguous slices (step 1) are supported")
        out.append((start, stop))
    return tuple(out)


def read_box_of(leaf: LeafPlan, region: tuple[slice, ...]) -> Box:
    """The leading-dimension bounds a region's read covers: (experts, rows), (rows), or () for a vector."""
    if len(leaf.shape) <= 1:
        return ()
    lead = 2 if leaf.kind in STACKED_KINDS else 1
    return bounds(region, leaf.shape)[:lead]


def read_box(leaf: LeafPlan, index: CheckpointIndex, box: Box) -> np.ndarray:
    """`materialize(leaf, index)` restricted to `box` along the leading dimensions, inner dimensions whole."""
    if not box:
        return materialize(leaf, index)
    if leaf.kind in STACKED_KINDS:
        (e0, e1), (r0, r1) = box
        parts = leaf.parts[e0:e1]
        shape = (e1 - e0, r1 - r0) + leaf.shape[2:]
    else:
        ((r0, r1),) = box
        parts = leaf.parts
        shape = (r1 - r0,) + leaf.shape[1:]
    rows = CheckpointIndex(index.directory, {
        name: _row_range(index.info(name), r0, r1) for part in parts for name in part
    })
    try:
        return materialize(dataclasses.replace(leaf, shape=shape, parts=tuple(parts)), rows)
    except CheckpointError as err:  # its indices count from the first row read
        raise CheckpointError(f"{err}; read as rows [{r0}, {r1}) of each tensor, indices from row {r0}") from None


def in_box(boxed: np.ndarray, leaf: LeafPlan, box: Box, region: tuple[slice, ...]) -> np.ndarray:
    """The region, cut from the array `read_box` gave for its box (leading dimensions relative to the box)."""
    local = [slice(start - lo, stop - lo) for (start, stop), (lo, _) in zip(bounds(region, leaf.shape), box)]
    return boxed[tuple(local) + tuple(region[len(box):])]


def leaf_array(leaf: LeafPlan, index: CheckpointIndex, sharding: NamedSharding) -> jax.Array:
    """The leaf as a global array in `sharding`; this process reads only its devices' read boxes, once
    each (devices that share a box, e.g. replicas, share the read)."""
    boxes: dict[Box, np.ndarray] = {}

    def callback(region: tuple[slice, ...]) -> np.ndarray:
        box = read_box_of(leaf, region)
        if box not in boxes:
            boxes[box] = read_box(leaf, index, box)
        return in_box(boxes[box], leaf, box, region)

    return jax.make_array_from_callback(leaf.shape, sharding, callback)


def _row_range(info: TensorInfo, r0: int, r1: int) -> TensorInfo:
    """Rows [r0, r1) of a tensor's leading axis: contiguous in the row-major layout, so one byte range."""
    if not info.shape or r1 > info.shape[0]:
        raise ValueError(f"{info.shard_path}: tensor {info.name!r} of shape {list(info.shape)} has no rows "
                         f"[{r0}, {r1})")
    row_bytes = info.nbytes // info.shape[0]
    return dataclasses.replace(info, shape=(r1 - r0,) + info.shape[1:],
                               start=info.start + r0 * row_bytes, stop=info.start + r1 * row_bytes)
