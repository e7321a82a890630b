"""Make one planned leaf from its source tensors: read, MXFP4 decode, stack, slice A_log, cast.

This is the only place tensor data is turned into model weights, for the direct loader and the
converter alike. Each piece is checked for NaN/inf after the cast, so a poisoned release is
reported with the tensor at fault instead of surfacing as NaN logits later.
"""

from __future__ import annotations

import numpy as np

from k3jax.checkpoint.mxfp4 import decode_mxfp4
from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex
from k3jax.convert.plan import LeafPlan


def materialize(leaf: LeafPlan, index: CheckpointIndex) -> np.ndarray:
    """The leaf's array, shape `leaf.shape` and dtype `leaf.dtype`, read only from `leaf.parts`."""
    if leaf.kind == "experts":
        out = np.empty(leaf.shape, leaf.dtype)
        for e, part in enumerate(leaf.parts):
            out[e] = _finite(_cast(_read_piece(part, index), leaf.dtype), part)
        return out
    (name,) = leaf.parts[0]
    array = index.read(name)
    if leaf.kind == "a_log":
        array = _a_log(array, name, leaf.shape[0])
    return _finite(_cast(array, leaf.dtype), leaf.parts[0])


def _read_piece(part: tuple[str, ...], index: CheckpointIndex) -> np.ndarray:
    if len(part) == 1:
        return index.read(part[0])
    packed, scale = part
    try:
        with np.errstate(over="ignore"):  # an overflow to inf is reported by `_finite`, with the names
            return decode_mxfp4(index.read(packed), index.read(scale))
    except ValueError as err:
        raise CheckpointError(f"tensors {packed} / {scale}: {err}") from None


def _a_log(stored: np.ndarray, name: str, num_heads: int) -> np.ndarray:
    """A_log is per head; the release stores it zero-padded to head_dim. Both forms are accepted."""
    if np.any(stored[num_heads:] != 0):
        raise CheckpointError(f"tensor {name}: entries past the {num_heads} heads must be zero padding")
    return stored[:num_heads]


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Through float32 when the dtype changes: one rounding, the same as the jnp cast it replaces."""
    return array if array.dtype == dtype else array.astype(np.float32).astype(dtype)


def _finite(array: np.ndarray, part: tuple[str, ...]) -> np.ndarray:
    bad = ~np.isfinite(array)
    if bad.any():
        nan = int(np.isnan(array).sum())
        first = np.argwhere(bad)[0].tolist()
        raise CheckpointError(
            f"tensor {' / '.join(part)} holds {nan} NaN and {int(bad.sum()) - nan} inf value(s) "
            f"(as {array.dtype.name}; first at index {first})"
        )
    return array
