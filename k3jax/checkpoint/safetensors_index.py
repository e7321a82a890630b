"""Header-only reader over a Hugging Face safetensors checkpoint directory.

The headers are parsed here (8-byte little-endian length + JSON) rather than by the safetensors
library so that a corrupt or inconsistent release gives an error naming the file and tensor at
fault, and so tensors (or row ranges of them) can be read without loading whole shards.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors stores little-endian data; ml_dtypes covers the types numpy lacks.
_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(dt)
    for name, dt in {
        "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu,
        "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
        "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
    }.items()
}


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or inconsistent with its index."""


def _fail(path: Path, what: str, name: str | None = None) -> CheckpointError:
    tensor = f" tensor {name!r}:" if name is not None else ""
    return CheckpointError(f"{path}:{tensor} {what}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``start``/``stop`` are absolute byte offsets in ``shard_path``."""

    name: str
    shard_path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def _load_json(path: Path, text: bytes | str, what: str):
    """Parse JSON, rejecting duplicate keys that json.loads would silently merge."""

    def no_duplicates(pairs):
        found = dict(pairs)
        if len(found) != len(pairs):  # linear: a real shard header has thousands of entries
            seen: set = set()
            dups = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
            raise _fail(path, f"{what} lists {dups[0]!r} more than once")
        return found

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(path, f"{what} is not valid JSON ({err})") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(path: Path, name: str, entry, data_start: int, data_len: int) -> TensorInfo:
    """Check one header entry against the dtype table and the data section's length."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise _fail(path, f"header entry must have dtype, shape, data_offsets; got {entry!r}", name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPES:
        raise _fail(path, f"unsupported dtype {dtype!r} (expected one of {sorted(_DTYPES)})", name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"shape must be a list of non-negative ints, got {shape!r}", name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
            or not 0 <= offsets[0] <= offsets[1]):
        raise _fail(path, "data_offsets must be [begin, end] with 0 <= begin <= end, "
                    f"got {offsets!r}", name)
    begin, end = offsets
    expected = math.prod(shape) * _DTYPES[dtype].itemsize
    if end - begin != expected:
        raise _fail(path, f"data_offsets {offsets} span {end - begin} bytes but {dtype} {shape} "
                    f"needs {expected}", name)
    if end > data_len:
        raise _fail(path, f"data_offsets {offsets} run past the end of the data section "
                    f"({data_len} bytes; file truncated?)", name)
    return TensorInfo(name, path, _DTYPES[dtype], tuple(shape), data_start + begin, data_start + end)


def _inside(path: Path, directory: Path) -> bool:
    """True when `path`, links resolved, is in `directory`, or (a Hugging Face hub snapshot, whose files
    are links to `../../blobs/<hash>`) in its repository's `blobs` folder."""
    top = directory.resolve()
    roots = [top] + ([top.parent.parent / "blobs"] if top.parent.name == "snapshots" else [])
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in roots)


def _shard_path(directory: Path, shard_name: str, source: Path, tensor: str | None = None) -> Path:
    """The file `shard_name` names in `directory`, checked to stay there: no absolute path, no `..`, no
    link out of it. `source` (the index, or the file itself) and `tensor` are named in the error."""
    what = f"maps tensors (e.g. {tensor!r}) to {shard_name!r}" if tensor is not None else f"file {shard_name!r}"
    parts = PurePosixPath(shard_name).parts
    if not parts or Path(shard_name).is_absolute() or PurePosixPath(shard_name).is_absolute() or ".." in parts:
        raise _fail(source, f"{what}: a shard must be a relative path inside {directory} (no absolute path, no '..')")
    path = directory / shard_name
    if not _inside(path, directory):
        raise _fail(source, f"{what}: {path} is a link to {path.resolve()}, outside {directory}")
    if path.is_dir():
        raise _fail(source, f"{what}, but {path} is a directory, not a shard file")
    if not path.is_file():
        raise _fail(source, f"{what}, but {path} does not exist")
    return path


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one shard's header without touching its data."""
    if not path.is_file():
        raise _fail(path, "shard file does not exist")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _fail(path, f"file has {size} bytes, too short for the 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise _fail(path, f"header length {header_len} runs past the end of the file ({size} bytes)")
        header = _load_json(path, f.read(header_len), "header")
    if not isinstance(header, dict):
        raise _fail(path, f"header must be a JSON object, got {type(header).__name__}")
    data_start = 8 + header_len
    tensors = {
        name: _parse_entry(path, name, entry, data_start, size - data_start)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    _check_overlaps(path, tensors.values())
    return tensors


def _check_overlaps(path: Path, tensors) -> None:
    """Two tensors sharing bytes means a corrupt header (reads would alias)."""
    last_stop, last_name = -1, None
    for t in sorted(tensors, key=lambda t: (t.start, t.stop)):
        if t.start < last_stop:
            raise _fail(path, f"bytes [{t.start}, {t.stop}) overlap tensor {last_name!r} "
                        f"(which ends at {last_stop})", t.name)
        if t.stop > last_stop:
            last_stop, last_name = t.stop, t.name


class CheckpointIndex:
    """Tensor name -> location over all shards of a checkpoint, validated when opened."""

    def __init__(self, directory: Path, tensors: dict[str, TensorInfo]):
        self.directory = directory
        self._tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> CheckpointIndex:
        """Read the index (or the single ``model.safetensors``) and every shard header it names."""
        directory = Path(path)
        index_path = directory / INDEX_FILE
        if index_path.is_file():
            return cls(directory, _open_sharded(_shard_path(directory, INDEX_FILE, index_path)))
        single = directory / SINGLE_FILE
        if single.is_file() or single.is_symlink():
            return cls(directory, _read_header(_shard_path(directory, SINGLE_FILE, single)))
        raise _fail(directory, f"neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise _fail(self.directory, "no such tensor in the checkpoint", name) from None

    def read(self, name: str) -> np.ndarray:
        """Read exactly this tensor's bytes, as its stored dtype (bf16 as ml_dtypes.bfloat16)."""
        info = self.info(name)
        return _read_bytes(info, info.start, info.nbytes).reshape(info.shape)

    def read_slice(self, name: str, index) -> np.ndarray:
        """``read(name)[index]`` reading only the rows spanned by the index's first-axis part.

        The first index must be an int or a slice (any step); further indices are applied in memory.
        """
        info = self.info(name)
        index = index if isinstance(index, tuple) else (index,)
        if not index:
            return self.read(name)
        if not info.shape:
            raise IndexError(f"{info.shard_path}: tensor {name!r} is a scalar and cannot be sliced")
        first, rest, n = index[0], index[1:], info.shape[0]
        if isinstance(first, slice):
            rows = range(*first.indices(n))
            lo, hi = (min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1) if rows else (0, 0)
            local_stop = rows.stop - lo if rows.stop - lo >= 0 else None
            return _read_rows(info, lo, hi)[(slice(rows.start - lo, local_stop, rows.step),) + rest]
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            if not -n <= first < n:
                raise IndexError(f"index {first} is out of bounds for tensor {name!r} "
                                 f"of shape {info.shape}")
            row = int(first) % n
            return _read_rows(info, row, row + 1)[(0,) + rest]
        raise IndexError(f"read_slice of {name!r}: first index must be an int or a slice, "
                         f"got {first!r}")


def _open_sharded(index_path: Path) -> dict[str, TensorInfo]:
    """Cross-check the index's weight_map against the headers of the shards it names."""
    index = _load_json(index_path, index_path.read_bytes(), "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _fail(index_path,
                    "expected a JSON object with a 'weight_map' of tensor name -> shard file")
    found: dict[str, TensorInfo] = {}
    examples = {shard_name: name for name, shard_name in reversed(weight_map.items())}  # first tensor of each
    shard_paths = {shard_name: _shard_path(index_path.parent, shard_name, index_path, examples[shard_name])
                   for shard_name in sorted(examples)}
    for shard_name in sorted(shard_paths):
        shard = shard_paths[shard_name]
        for name, info in _read_header(shard).items():
            if name in found:
                raise _fail(shard, f"duplicate tensor, also stored in {found[name].shard_path}", name)
            found[name] = info
    for name, shard_name in weight_map.items():
        info = found.get(name)
        if info is None or info.shard_path is not shard_paths[shard_name]:  # each shard's one Path object
            raise _fail(index_path.parent / shard_name, f"listed in {INDEX_FILE} for this shard, "
                        "but the shard's header has no such tensor", name)
    extra = sorted(found.keys() - weight_map.keys())
    if extra:
        raise _fail(found[extra[0]].shard_path, f"stored in this shard but not listed in {index_path}",
                    extra[0])
    return found


def _read_rows(info: TensorInfo, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of the first axis; rows are contiguous in the row-major layout."""
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    data = _read_bytes(info, info.start + lo * row_bytes, (hi - lo) * row_bytes)
    return data.reshape((hi - lo,) + info.shape[1:])


def _read_bytes(info: TensorInfo, offset: int, nbytes: int) -> np.ndarray:
    buf = bytearray(nbytes)
    with info.shard_path.open("rb") as f:
        f.seek(offset)
        got = f.readinto(buf)
    if got != nbytes:
        raise _fail(info.shard_path, f"read {got} of {nbytes} bytes at offset {offset} "
                    "(file shrank since the header was read?)", info.name)
    return np.frombuffer(buf, dtype=info.dtype)

