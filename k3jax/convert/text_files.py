"""The release's text files in a conversion output: its config, tokenizer and generation settings, so the
output loads and tokenizes on its own (`k3jax generate --model OUT`).

Each run (fresh or resumed) copies them again (they are small), each one written under a temporary
name, fsynced and renamed, and records its sha256 in the manifest (`text_files`), which `--verify`
and `from_pretrained(OUT, verify=True)` check. Nothing is written through a link: an output file
that is a symbolic link is refused. A source file may be a link only within the release (or, in a
Hugging Face hub snapshot, to its `blobs`), as for the safetensors shards.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.checkpoint.store import remove_path
from k3jax.load.converted import TEXT_FILES_KEY, text_file_mismatch
from k3jax.tokenizer_files import TOKENIZER_FILES

REQUIRED = ("config.json",)
# Everything text the release ships that is read to use the model: config, tokenizer, generation settings.
TEXT_FILES = (*REQUIRED, *TOKENIZER_FILES, "special_tokens_map.json", "generation_config.json")


def copy_text_files(hf_dir: Path, root: Path, manifest: dict) -> None:
    """Copy every TEXT_FILES file the release has into `root` and record its sha256 in `manifest` (the
    caller writes it); a file an earlier run copied that the release no longer has is removed."""
    recorded: dict[str, str] = {}
    for name in TEXT_FILES:
        source = _source(hf_dir, name)
        target = root / name
        if target.is_symlink():
            raise CheckpointError(f"{target} is a symbolic link; a conversion output must hold its own files "
                                  "(nothing is deleted or written through a link)")
        if source is None:
            if name in manifest.get(TEXT_FILES_KEY, {}):
                target.unlink(missing_ok=True)
            continue
        data = source.read_bytes()
        _write_atomic(target, data)
        recorded[name] = hashlib.sha256(data).hexdigest()
    manifest[TEXT_FILES_KEY] = recorded


def check_text_files(root: Path, hf_dir: Path, manifest: dict) -> None:
    """`--verify`: each copied file matches the manifest's sha256 and the release's file."""
    why = text_file_mismatch(root, manifest)
    for name, digest in manifest.get(TEXT_FILES_KEY, {}).items() if why is None else ():
        source = _source(hf_dir, name)
        if source is None or hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            why = f"{root / name} differs from {hf_dir / name}"
            break
    if why is not None:
        raise CheckpointError(f"verification of {root} failed: {why}; `k3jax convert --resume` copies it again")


def _source(hf_dir: Path, name: str) -> Path | None:
    """The release's file `name`, or None if it has none; a link out of the release is refused."""
    path = hf_dir / name
    if not (path.is_symlink() or path.exists()):
        return None
    top = hf_dir.resolve()
    allowed = [top] + ([top.parent.parent / "blobs"] if top.parent.name == "snapshots" else [])
    resolved = path.resolve()
    if not any(resolved.is_relative_to(folder) for folder in allowed):
        raise CheckpointError(f"{path} is a link to {resolved}, outside {hf_dir}: release files are read only "
                              "from the release")
    if not resolved.is_file():
        raise CheckpointError(f"{path} is not a file")
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a new temporary file (never opened through a link), fsync it and rename it to `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    remove_path(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
