"""The converted directory on disk: per-item Orbax checkpoints, the manifest and the COMPLETE marker.

    OUT/config.json         the release's config, so OUT loads on its own
    OUT/items/<item>/       one Orbax PyTree checkpoint per item (embed, layer_000 ..., head)
    OUT/manifest.json       settings, plan fingerprint, and per committed item its leaves'
                            shape, dtype and sha256
    OUT/COMPLETE            written last; holds the sha256 of the final manifest

Every step is atomic under SIGKILL: an item is saved under a `.tmp` name and renamed once Orbax has
finished it, and only then added to the manifest, itself replaced atomically. So a directory is
either COMPLETE (and then loadable) or resumable, and anything not in the manifest is debris.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from k3jax.checkpoint.safetensors_index import CheckpointError

MANIFEST, COMPLETE, ITEMS = "manifest.json", "COMPLETE", "items"
FORMAT, VERSION = "k3jax-converted", 1


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def leaf_checksum(array: np.ndarray) -> str:
    """sha256 of the leaf's raw bytes in C order (shape and dtype are recorded beside it)."""
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


def leaf_record(array: np.ndarray) -> dict:
    return {"shape": list(array.shape), "dtype": array.dtype.name, "sha256": leaf_checksum(array)}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(root: Path, manifest: dict) -> None:
    _write_atomic(root / MANIFEST, json.dumps(manifest, indent=1))


def read_manifest(root: Path) -> dict:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{root / MANIFEST}: cannot read the conversion manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{root / MANIFEST}: not a {FORMAT} v{VERSION} manifest")
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
    return read_manifest(root)


def _nest(leaves: dict[str, np.ndarray]) -> dict:
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


class ItemStore:
    """Saves and restores items as Orbax PyTree checkpoints of host (numpy) arrays.

    Synchronous and uncompressed, to keep peak memory near one item per item in flight: Orbax's
    staging copy is skipped (`_Unstaged`; it used to add one item: +50 MiB on 50 MiB items), and the
    default zstd compression gains little on weights (+70 MiB, and the peak crept up by ~10 MiB per item).
    """

    def __init__(self, root: Path) -> None:
        self.items = root / ITEMS
        self._checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    def path(self, item: str) -> Path:
        return self.items / item

    def save(self, item: str, leaves: dict[str, np.ndarray]) -> None:
        """Write under a temporary name and rename when Orbax has finished: no half item has the real name."""
        self.items.mkdir(exist_ok=True)
        tmp = self.items / f"{item}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        self._checkpointer.save(tmp, _nest({k: np.ascontiguousarray(v).view(_Unstaged) for k, v in leaves.items()}))
        os.rename(tmp, self.path(item))

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
        args = ocp.args.PyTreeRestore(item=_nest(abstract), restore_args=_nest(restore_args))
        return _flatten(self._checkpointer.restore(path, args=args))

    def remove_all_but(self, committed: set[str]) -> None:
        """Delete whatever a killed run left that the manifest does not list (temporaries, unlisted items)."""
        if not self.items.is_dir():
            return
        for entry in self.items.iterdir():
            if entry.name not in committed:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
