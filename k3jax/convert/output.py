"""The output directory of a conversion, shared by the single-process and the sharded converter:
opening it (fresh, or resumed after checking it is the same conversion) and verifying it.

Layout and atomicity: `checkpoint.store`. COMPLETE is written last, after the optional
verification, so a failed or interrupted run never looks finished. A resumed run skips only the
items that are still whole on disk (every file recorded at commit present, at its size) and makes
the others again, so resuming never certifies a damaged output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.checkpoint.store import (
    CHECKSUM,
    COMPLETE,
    FORMAT,
    MANIFEST,
    VERSION,
    ItemStore,
    check_no_links,
    read_manifest,
    write_manifest,
)
from k3jax.convert.planned import PlannedConversion
from k3jax.convert.text_files import check_text_files, copy_text_files
from k3jax.convert.verify import LOGITS_CHECK_MAX_BYTES, check_logits, find_bad_items


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    written: int  # items written by this call
    skipped: int  # items already committed by an earlier, interrupted call
    nbytes: int  # size of the whole converted model
    seconds: float


def open_output(root: Path, planned: PlannedConversion, resume: bool, store: ItemStore) -> dict:
    """A fresh manifest for an empty or new directory, or the one to resume after checking it matches,
    its damaged items dropped (`drop_damaged`); either way with the release's text files copied again."""
    if root.exists() and any(root.iterdir()):
        check_no_links(root)
        if not resume:
            raise CheckpointError(f"{root} is not empty; pass --resume to continue a conversion there, "
                                  "or choose a new directory")
        if not (root / MANIFEST).is_file():
            raise CheckpointError(f"{root} is not empty and has no {MANIFEST}: there is no conversion to resume")
        manifest = read_manifest(root)
        for key, value in planned.settings.items():
            if manifest.get(key) != value:
                raise CheckpointError(
                    f"{root} was started with {key}={manifest.get(key)!r} but this run has {value!r} "
                    "(different source checkpoint or options); use a new directory"
                )
        drop_damaged(root, store, manifest)
    else:
        root.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "version": VERSION, "checksum": CHECKSUM, **planned.settings,
                    "source": str(planned.hf_dir.resolve()), "items": {}, "files": {}}
        write_manifest(root, manifest)
    copy_text_files(planned.hf_dir, root, manifest)
    write_manifest(root, manifest)
    return manifest


def drop_damaged(root: Path, store: ItemStore, manifest: dict) -> list[str]:
    """Remove from `manifest` (and from disk) every committed item that is no longer whole, so that it is
    converted again; COMPLETE goes too when there is any. An item committed without a file list (an
    older converter) is checked by its checksums instead, and its files recorded. Returns the items dropped."""
    files = manifest.setdefault("files", {})
    damaged = []
    for name, leaves in list(manifest["items"].items()):
        if store.damage(name, files.get(name), leaves) is not None:
            damaged.append(name)
            del manifest["items"][name]
            files.pop(name, None)
        elif name not in files:
            files[name] = store.files(name)
    if damaged:
        (root / COMPLETE).unlink(missing_ok=True)
    write_manifest(root, manifest)
    return damaged


def verify_output(root: Path, store: ItemStore, planned: PlannedConversion, manifest: dict) -> None:
    """Drop failing items from the manifest (so `--resume` rewrites them) and fail; else check the text
    files and the logits."""
    bad = find_bad_items(store, planned.plan, planned.index, manifest)
    if bad:
        for name in bad:
            manifest["items"].pop(name, None)
            manifest.get("files", {}).pop(name, None)
        (root / COMPLETE).unlink(missing_ok=True)
        write_manifest(root, manifest)
        store.remove_all_but(set(manifest["items"]))
        details = "; ".join(f"{name}: {why}" for name, why in bad.items())
        raise CheckpointError(f"verification of {root} failed for {len(bad)} item(s), removed so that "
                              f"--resume rewrites them: {details}")
    check_text_files(root, planned.hf_dir, manifest)
    if planned.plan.nbytes <= LOGITS_CHECK_MAX_BYTES:
        check_logits(root, manifest, planned.abstract.config, planned.index)
