"""The converted directory on disk: per-item Orbax checkpoints, the manifest and the COMPLETE marker.

    OUT/config.json         the release's config, so OUT loads on its own
    OUT/tiktoken.model, tokenizer_config.json, ...  the release's text files (k3jax.convert.text_files),
                            sha256 in the manifest's "text_files"
    OUT/items/<item>/       one Orbax PyTree checkpoint per item (embed, layer_000 ..., head)
    OUT/manifest.json       settings, plan fingerprint, the checksum algorithm ("crc32", see
                            `checksum`), and per committed item its leaves' shape, dtype and crc32
                            ("items") and its files' sizes ("files")
    OUT/COMPLETE            written last; holds the sha256 of the final manifest

Every step is atomic under SIGKILL, and durable unless `sync=False`: an item is written under a
`.tmp` name, its files are fsynced and it is renamed (`ItemStore.commit`), and only then added to
the manifest, itself replaced atomically. So a directory is either COMPLETE (and then loadable) or resumable, and
anything not in the manifest is debris. Nothing here follows a symbolic link when it deletes: an output
whose parts are links is refused (`check_no_links`). TensorStore's own per-file fsync is off (`_UnsyncedNumpyHandler`)
so that the writing thread never waits for the disk; `commit` does the fsync, and the converter
runs it for one item while the next is being written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from k3jax.checkpoint.checksum import ALGORITHM as CHECKSUM
from k3jax.checkpoint.checksum import crc32_of
from k3jax.checkpoint.safetensors_index import CheckpointError

MANIFEST, COMPLETE, ITEMS = "manifest.json", "COMPLETE", "items"
# v1 recorded sha256 per leaf; v2 records crc32. Loading reads only shapes and dtypes, so both load;
# resuming compares checksums, so only the current version resumes.
FORMAT, VERSION, LOADABLE_VERSIONS = "k3jax-converted", 2, (1, 2)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def remove_path(path: Path) -> None:
    """Delete `path` without following links: a link is removed itself, never what it points to; a
    directory with everything under it (`shutil.rmtree` removes nested links, not their targets)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def check_no_links(root: Path) -> None:
    """Refuse an output directory whose parts (manifest, marker, config, items and what is in them) are
    symbolic links: resuming deletes and rewrites there, and must not reach outside `root`."""
    parts = [root / MANIFEST, root / COMPLETE, root / "config.json", root / ITEMS]
    if (root / ITEMS).is_dir() and not (root / ITEMS).is_symlink():
        for folder, dirs, files in os.walk(root / ITEMS):  # os.walk does not descend into linked folders
            parts += [Path(folder, name) for name in [*dirs, *files]]
    for path in parts:
        if path.is_symlink():
            raise CheckpointError(f"{path} is a symbolic link; a conversion output must hold its own files "
                                  "(nothing is deleted or written through a link)")


def leaf_checksum(array: np.ndarray) -> str:
    """CRC-32 of the leaf's raw bytes in C order, 8 hex digits (shape and dtype are recorded beside it)."""
    return f"{crc32_of(array):08x}"


def leaf_record(array: np.ndarray) -> dict:
    return {"shape": list(array.shape), "dtype": array.dtype.name, CHECKSUM: leaf_checksum(array)}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(root: Path, manifest: dict) -> None:
    _write_atomic(root / MANIFEST, json.dumps(manifest, indent=1))


def read_manifest(root: Path, *, versions: tuple[int, ...] = (VERSION,)) -> dict:
    """The manifest, if its format version is one of `versions` (by default only the one this code writes)."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{root / MANIFEST}: cannot read the conversion manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{root / MANIFEST}: not a {FORMAT} manifest")
    if manifest.get("version") not in versions:
        raise CheckpointError(
            f"{root / MANIFEST}: a {FORMAT} v{manifest.get('version')} manifest "
            f"(checksums: {manifest.get('checksum', 'sha256')}); this converter resumes only v{VERSION} "
            f"({CHECKSUM}) conversions: convert again into a new directory"
        )
    return manifest


def mark_complete(root: Path) -> None:
    digest = hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()
    _write_atomic(root / COMPLETE, json.dumps({"manifest_sha256": digest}) + "\n")


def read_complete_manifest(root: Path) -> dict:
    """The manifest of a finished conversion; an unfinished or altered one is an error."""
    if not (root / COMPLETE).is_file():
        raise CheckpointError(
            f"{root} holds an incomplete conversion (no {COMPLETE} marker); finish it with "
            f"`k3jax convert HF_DIR {root} --resume`"
        )
    digest = hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()
    try:
        recorded = json.loads((root / COMPLETE).read_text())["manifest_sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        recorded = None
    if recorded != digest:
        raise CheckpointError(f"{root / MANIFEST} does not match the checksum in {root / COMPLETE}")
    return read_manifest(root, versions=LOADABLE_VERSIONS)


def nest(leaves: dict[str, np.ndarray]) -> dict:
    """{"a.b": x} -> {"a": {"b": x}}: leaf names as the nested tree Orbax saves."""
    tree: dict = {}
    for name, array in leaves.items():
        *parents, last = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = array
    return tree


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    flat: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


class _Unstaged(np.ndarray):
    """A view Orbax's numpy handler does not copy: it deep-copies every array before its background
    write (a whole item of staging memory and a memcpy), which a synchronous save of arrays that
    nobody mutates meanwhile does not need. Restores give plain ndarrays."""

    def __deepcopy__(self, memo):
        return self


class _UnsyncedNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler with TensorStore's `file_io_sync` off: by default every data file is
    fsynced before its write completes, so the writer waits for the disk, which is slower than the
    page cache. `ItemStore.commit` fsyncs the finished item instead, off the writing thread.

    The child context keeps everything else of Orbax's per-save context (the OCDBT cache pool shared
    by all arrays of one save); one child per save, so the arrays of a save share one database."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._parent: ts.Context | None = None
        self._child: ts.Context | None = None

    async def _open_and_write(self, value: np.ndarray, tspec: dict, ts_context: ts.Context) -> None:
        with self._lock:
            if self._parent is not ts_context:
                self._parent = ts_context
                self._child = ts.Context(ts.Context.Spec({"file_io_sync": False}), ts_context)
            context = self._child
        await super()._open_and_write(value, tspec, context)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, `root` included."""
    for folder, _, files in os.walk(root):
        for name in [*files, "."]:
            _fsync(Path(folder, name))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ItemStore:
    """Saves and restores items as Orbax PyTree checkpoints of host (numpy) arrays.

    Synchronous and uncompressed, to keep peak memory near one item per item in flight: Orbax's
    staging copy is skipped (`_Unstaged`; it would hold a second copy of every item), and the default
    zstd compression gains little on weights while its buffers raise the peak, item after item.
    """

    def __init__(self, root: Path) -> None:
        self.items = root / ITEMS
        self._checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        # jax.Array keeps Orbax's own handler: the items are numpy, but a registry without it makes
        # Orbax warn on every save that array metadata persistence is off.
        writes = ocp.type_handlers.create_type_handler_registry(
            (np.ndarray, _UnsyncedNumpyHandler()), (jax.Array, ocp.type_handlers.ArrayHandler())
        )
        self._writer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False,
                                                                    type_handler_registry=writes))

    def path(self, item: str) -> Path:
        return self.items / item

    def save(self, item: str, leaves: dict[str, np.ndarray]) -> None:
        """`write` then `commit`."""
        self.write(item, leaves)
        self.commit(item)

    def write(self, item: str, leaves: dict[str, np.ndarray]) -> None:
        """Write the item under a temporary name; its data may still be only in the page cache."""
        self.items.mkdir(exist_ok=True)
        tmp = self._tmp(item)
        remove_path(tmp)
        self._writer.save(tmp, nest({k: np.ascontiguousarray(v).view(_Unstaged) for k, v in leaves.items()}))

    def commit(self, item: str, *, sync: bool = True) -> None:
        """Make the written item durable (fsync; skipped with `sync=False`), then give it its name: no
        half item ever has it."""
        tmp = self._tmp(item)
        if sync:
            _fsync_tree(tmp)
        os.rename(tmp, self.path(item))
        if sync:
            _fsync(self.items)

    def _tmp(self, item: str) -> Path:
        return self.items / f"{item}.tmp"

    def restore(self, item: str) -> dict[str, np.ndarray]:
        """Host arrays, whoever wrote the item: a sharded conversion saves jax.Arrays, which Orbax would
        otherwise restore onto the writer's mesh (and cannot restore where those devices do not exist)."""
        path = self.path(item)
        if not path.is_dir():
            raise CheckpointError(f"{path}: item directory is missing")
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                self._checkpointer.metadata(path).item_metadata.tree)
        return _flatten(self._checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy)))

    def restore_sharded(self, item: str, abstract: dict[str, "jax.ShapeDtypeStruct"]) -> dict[str, "jax.Array"]:
        """Restore straight into each leaf's `.sharding` (a ShapeDtypeStruct per leaf name): every device
        reads its own slices; no host copy of the whole item is made."""
        path = self.path(item)
        if not path.is_dir():
            raise CheckpointError(f"{path}: item directory is missing")
        restore_args = {
            name: ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=tuple(leaf.shape), dtype=leaf.dtype)
            for name, leaf in abstract.items()
        }
        args = ocp.args.PyTreeRestore(item=nest(abstract), restore_args=nest(restore_args))
        return _flatten(self._checkpointer.restore(path, args=args))

    def remove_all_but(self, committed: set[str]) -> None:
        """Delete whatever a killed run left that the manifest does not list (temporaries, unlisted items);
        links are removed themselves, never followed, and a linked `items` folder is refused."""
        if self.items.is_symlink():
            raise CheckpointError(f"{self.items} is a symbolic link; a conversion output must hold its own files "
                                  "(nothing is deleted or written through a link)")
        if not self.items.is_dir():
            return
        for entry in self.items.iterdir():
            if entry.name not in committed:
                remove_path(entry)

    def files(self, item: str) -> dict[str, int]:
        """The item's files (paths relative to its directory) and their sizes, as recorded at commit."""
        path = self.path(item)
        found = {}
        for folder, _, names in os.walk(path):
            for name in names:
                file = Path(folder, name)
                found[str(file.relative_to(path))] = file.lstat().st_size
        return dict(sorted(found.items()))

    def damage(self, item: str, files: dict[str, int] | None, leaves: dict[str, dict]) -> str | None:
        """What is wrong with a committed item, or None when it is whole: its files as recorded (`files`),
        or, when no file list was recorded, its leaves' checksums as recorded (a full read of the item)."""
        path = self.path(item)
        if path.is_symlink() or not path.is_dir():
            return f"{path} is missing"
        if files is None:
            return self.checksum_mismatch(item, leaves)
        found = self.files(item)
        for name, size in files.items():
            if name not in found:
                return f"{path / name} is missing"
            if found[name] != size:
                return f"{path / name} has {found[name]} bytes, {size} were written"
        return None

    def checksum_mismatch(self, item: str, leaves: dict[str, dict], arrays: dict | None = None) -> str | None:
        """The first leaf whose shape, dtype or checksum differs from its manifest record (`leaves`), or
        None; `arrays` are the item's host arrays if already restored (else it is restored: a full read)."""
        try:
            arrays = self.restore(item) if arrays is None else arrays
        except Exception as err:  # any failure to read the item back is damage to report
            return f"{self.path(item)} cannot be restored ({type(err).__name__}: {err})"
        if set(arrays) != set(leaves):
            return f"{self.path(item)} holds leaves {sorted(arrays)}, the manifest lists {sorted(leaves)}"
        for name, record in leaves.items():
            found = leaf_record(np.asarray(arrays[name]))
            if any(found[key] != record.get(key) for key in found):
                return (f"{self.path(item)}: leaf {name} is {found['dtype']}{found['shape']} {CHECKSUM} "
                        f"{found[CHECKSUM]}, the manifest records {record.get('dtype')}{record.get('shape')} "
                        f"{CHECKSUM} {record.get(CHECKSUM)}")
        return None
