"""Make one planned leaf from its source tensors: read, MXFP4 decode, stack, slice A_log, cast.

This is the only place tensor data is turned into model weights, for the direct loader and the
converter alike. Each piece is checked for NaN/inf after the cast, so a poisoned release is
reported with the tensor at fault instead of surfacing as NaN logits later.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from k3jax.checkpoint.release_plan import ItemPlan, LeafPlan
from k3jax.checkpoint.safetensors_index import CheckpointError, CheckpointIndex, TensorInfo
from pallas_kernels.mxfp4 import decode_mxfp4


def materialize(leaf: LeafPlan, index: CheckpointIndex) -> np.ndarray:
    """The leaf's array, shape `leaf.shape` and dtype `leaf.dtype`, read only from `leaf.parts`."""
    if leaf.kind == "experts":
        out = np.empty(leaf.shape, leaf.dtype)
        for e, part in enumerate(leaf.parts):
            if len(part) == 2:  # MXFP4 codes + scales: the table decode, as `materialize_item` uses
                out[e] = _decode_pair(part, index.read(part[0]), index.read(part[1]), leaf.dtype)
            else:
                out[e] = _finite(_cast(index.read(part[0]), leaf.dtype), part)
        return out
    if leaf.kind in ("mxfp4_packed", "mxfp4_scale"):
        which = 0 if leaf.kind == "mxfp4_packed" else 1
        out = np.empty(leaf.shape, np.uint8)
        for e, part in enumerate(leaf.parts):
            out[e] = index.read(part[which])
            if which == 1 and out[e].max(initial=0) >= _SCALE_MAY_OVERFLOW:
                _finite(_read_piece(part, index), part)  # NaN byte 255, or blocks decoding to inf
        return out
    (name,) = leaf.parts[0]
    array = index.read(name)
    if leaf.kind == "a_log":
        array = _a_log(array, name, leaf.shape[0])
    return _finite(_cast(array, leaf.dtype), leaf.parts[0])


# 6 (the largest E2M1 value) * 2^(253 - 127) = 1.5 * 2^128 overflows float32; lower scale bytes never do.
_SCALE_MAY_OVERFLOW = 253


def _read_piece(part: tuple[str, ...], index: CheckpointIndex) -> np.ndarray:
    if len(part) == 1:
        return index.read(part[0])
    return _read_piece_arrays(part, index.read(part[0]), index.read(part[1]))


def _a_log(stored: np.ndarray, name: str, num_heads: int) -> np.ndarray:
    """A_log is per head; the release stores it zero-padded to head_dim. Both forms are accepted."""
    if np.any(stored[num_heads:] != 0):
        raise CheckpointError(f"tensor {name}: entries past the {num_heads} heads must be zero padding")
    return stored[:num_heads]


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Through float32 when the dtype changes: one rounding, the same as the jnp cast it replaces."""
    return array if array.dtype == dtype else array.astype(np.float32).astype(dtype)


def _finite(array: np.ndarray, part: tuple[str, ...]) -> np.ndarray:
    if _all_finite(array):
        return array
    bad = ~np.isfinite(array)
    nan = int(np.isnan(array).sum())
    first = np.argwhere(bad)[0].tolist()
    raise CheckpointError(
        f"tensor {' / '.join(part)} holds {nan} NaN and {int(bad.sum()) - nan} inf value(s) "
        f"(as {array.dtype.name}; first at index {first})"
    )


# An IEEE value is inf or NaN exactly when its exponent bits are all ones.
_EXPONENT_BITS = {
    np.dtype(ml_dtypes.bfloat16): np.uint16(0x7F80), np.dtype(np.float16): np.uint16(0x7C00),
    np.dtype(np.float32): np.uint32(0x7F800000), np.dtype(np.float64): np.uint64(0x7FF0000000000000),
}
_CHECK_BLOCK = 1 << 18  # elements tested at a time, so that the temporaries stay in cache


def _all_finite(array: np.ndarray) -> bool:
    """`np.isfinite(array).all()`, tested on the bits block by block: much faster on bfloat16, whose
    isfinite is an unvectorised ml_dtypes loop, and no full-size temporary for any dtype."""
    mask = _EXPONENT_BITS.get(array.dtype)
    if mask is None or not array.flags.c_contiguous:
        return bool(np.isfinite(array).all())
    bits = array.reshape(-1).view(mask.dtype)
    return not any(np.any((bits[i:i + _CHECK_BLOCK] & mask) == mask) for i in range(0, bits.size, _CHECK_BLOCK))


# ---- a whole item at once, reading its source bytes in file order --------------------------------

READ_RUN_BYTES = 64 << 20  # one read covers adjacent tensors up to this size (a larger tensor: one read)
_READ_GAP_BYTES = 1 << 20  # tensors this close together are read in one go, gap included


def materialize_item(item: ItemPlan, index: CheckpointIndex, buffer: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """`{leaf.target: materialize(leaf, index)}` for every leaf of `item`, bit for bit, but reading the
    item's source tensors in (shard, offset) order with large coalesced reads instead of one small read
    per tensor in plan order. Releases sort tensors by dtype and name (`experts.10` before
    `experts.2`), so per-tensor reads of a layer's experts seek all over the shard; this reads each
    shard region once, sequentially.

    A tensor stored exactly as its leaf keeps it (MXFP4 codes and scales, same-dtype experts and
    copies: nearly all bytes) is read by the kernel straight into its place in the output (one
    `preadv` per run, scattering the run over its destinations), so its bytes are copied once, not
    read into a buffer and copied again. Only tensors that are cast, decoded or sliced get a buffer.

    With `buffer` (uint8, at least `item_buffer_bytes(item)`), the leaves are views into it: a caller
    converting many items reuses a few buffers instead of faulting in fresh memory for every item
    (kernel time per page touched)."""
    consumers: dict[str, list] = {}  # tensor name -> [(leaf, expert index or None, which of the pair)]
    for leaf in item.leaves:
        for e, part in enumerate(leaf.parts):
            for which, name in enumerate(part):
                if leaf.kind == "mxfp4_packed" and which != 0 or leaf.kind == "mxfp4_scale" and which != 1:
                    continue
                expert = None if leaf.kind in ("copy", "a_log") else e
                consumers.setdefault(name, []).append((leaf, expert, which))
    out = _leaf_arrays(item, buffer)
    pending: dict[tuple[str, int], dict[int, np.ndarray]] = {}  # (leaf, expert) -> halves of an MXFP4 pair
    check_scales: list[tuple[LeafPlan, int]] = []

    def destination(info: TensorInfo) -> np.ndarray | None:
        """The output slot this tensor's bytes can be read into as they are, if there is one."""
        if len(consumers[info.name]) != 1:
            return None
        leaf, e, _ = consumers[info.name][0]
        if leaf.kind in ("mxfp4_packed", "mxfp4_scale") or leaf.kind == "experts" and len(leaf.parts[e]) == 1:
            slot = out[leaf.target][e]
        elif leaf.kind == "copy":
            slot = out[leaf.target]
        else:
            return None
        return slot if slot.dtype == info.dtype and slot.shape == info.shape else None

    def check_in_place(name: str, array: np.ndarray) -> None:
        leaf, e, _ = consumers[name][0]
        if leaf.kind == "mxfp4_scale" and array.max(initial=0) >= _SCALE_MAY_OVERFLOW:
            check_scales.append((leaf, e))
        elif leaf.kind in ("experts", "copy"):
            _finite(array, leaf.parts[e] if e is not None else leaf.parts[0])

    def consume(name: str, array: np.ndarray) -> None:
        for leaf, e, which in consumers[name]:
            part = leaf.parts[e] if e is not None else leaf.parts[0]
            if leaf.kind in ("mxfp4_packed", "mxfp4_scale"):
                out[leaf.target][e] = array
                if leaf.kind == "mxfp4_scale" and array.max(initial=0) >= _SCALE_MAY_OVERFLOW:
                    check_scales.append((leaf, e))
            elif leaf.kind == "experts" and len(part) == 2:
                halves = pending.setdefault((leaf.target, e), {})
                halves[which] = array
                if len(halves) == 2:
                    del pending[(leaf.target, e)]
                    out[leaf.target][e] = _decode_pair(part, halves[0], halves[1], leaf.dtype)
            elif leaf.kind == "experts":
                out[leaf.target][e] = _finite(_cast(array, leaf.dtype), part)
            else:
                value = _a_log(array, name, leaf.shape[0]) if leaf.kind == "a_log" else array
                out[leaf.target] = _finite(_cast(value, leaf.dtype), part)

    def read(run: list[TensorInfo]) -> None:
        slots = [destination(info) for info in run]
        arrays = _read_run(run, slots)
        for info, slot, array in zip(run, slots, arrays):
            (check_in_place if slot is not None else consume)(info.name, array)

    infos = sorted((index.info(name) for name in consumers), key=lambda i: (str(i.shard_path), i.start))
    run: list[TensorInfo] = []
    for info in infos:
        if run and (info.shard_path != run[0].shard_path or info.start - run[-1].stop > _READ_GAP_BYTES
                    or info.stop - run[0].start > READ_RUN_BYTES):
            read(run)
            run = []
        run.append(info)
    if run:
        read(run)
    for leaf, e in check_scales:  # NaN byte or blocks that overflow: the same error as a decode would give
        _finite(_read_piece(leaf.parts[e], index), leaf.parts[e])
    return {leaf.target: out[leaf.target] for leaf in item.leaves}


def _decode_pair(part: tuple[str, ...], packed: np.ndarray, scale: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """One MXFP4 pair decoded to `dtype` (errors name the two tensors), checked finite where a scale
    byte allows an overflow (below it, |value| <= 6 * 2^125 is always finite)."""
    values = _read_piece_arrays(part, packed, scale)
    if scale.max(initial=0) >= _SCALE_MAY_OVERFLOW:
        _finite(values, part)
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):  # exact: MXFP4 values have two significant bits
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    return _cast(values, dtype)


def _read_piece_arrays(part: tuple[str, ...], packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The reference decode of an MXFP4 pair; its errors name the two tensors."""
    try:
        with np.errstate(over="ignore"):  # an overflow to inf is reported by `_finite`, with the names
            return decode_mxfp4(packed, scale)
    except ValueError as err:
        raise CheckpointError(f"tensors {part[0]} / {part[1]}: {err}") from None


_ALIGN = 4096  # leaf offsets in a shared buffer are rounded up to this


def item_buffer_bytes(item: ItemPlan) -> int:
    """Size of a buffer that holds all of the item's leaves (see `materialize_item`)."""
    return sum(-(-leaf.nbytes // _ALIGN) * _ALIGN for leaf in item.leaves)


def _leaf_arrays(item: ItemPlan, buffer: np.ndarray | None) -> dict[str, np.ndarray]:
    """Empty output arrays for the leaves read in place (all but A_log), new or carved out of `buffer`."""
    if buffer is None:
        return {leaf.target: np.empty(leaf.shape, leaf.dtype) for leaf in item.leaves if leaf.kind != "a_log"}
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.nbytes < item_buffer_bytes(item):
        raise ValueError(f"item {item.name}: buffer must be uint8[>= {item_buffer_bytes(item)}], got "
                         f"{buffer.dtype.name}{list(buffer.shape)}")
    arrays, offset = {}, 0
    for leaf in item.leaves:
        if leaf.kind != "a_log":
            arrays[leaf.target] = buffer[offset:offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
        offset += -(-leaf.nbytes // _ALIGN) * _ALIGN
    return arrays


_IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers per preadv call


def _read_run(run: list[TensorInfo], slots: list[np.ndarray | None]) -> list[np.ndarray]:
    """Read [run[0].start, run[-1].stop) of one shard with `preadv`: each tensor lands in its slot (or a
    new array), the gaps between tensors in throwaway buffers. Returns the tensors' arrays."""
    arrays, views, pos = [], [], run[0].start
    for info, slot in zip(run, slots):
        if info.start > pos:
            views.append(memoryview(bytearray(info.start - pos)))
        array = slot if slot is not None else np.empty(info.shape, info.dtype)
        arrays.append(array)
        views.append(memoryview(array.reshape(-1).view(np.uint8)))
        pos = info.stop
    with run[0].shard_path.open("rb", buffering=0) as f:
        got = _preadv_all(f.fileno(), views, run[0].start)
    for info in run:
        if info.stop - run[0].start > got:
            have = max(0, got - (info.start - run[0].start))
            raise CheckpointError(f"{info.shard_path}: tensor {info.name!r}: read {have} of {info.nbytes} bytes at "
                                  f"offset {info.start} (file shrank since the header was read?)")
    return arrays


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill `views` in order from `offset` on, however the kernel splits the reads; the bytes read
    (fewer only at the end of the file)."""
    total, first = 0, 0
    while first < len(views):
        n = os.preadv(fd, views[first:first + _IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]
    return total
