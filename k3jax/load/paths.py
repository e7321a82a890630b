"""Where a checkpoint lives: a local directory, or a URL (`gs://bucket/k3`, `s3://...`) read through
etils `epath.Path`, Orbax's own path type.

A local path is made absolute (Orbax needs absolute paths); a URL is kept exactly as given, since
`pathlib.Path` / `os.path.abspath` would turn `gs://bucket/k3` into `gs:/bucket/k3` or
`/cwd/gs:/bucket/k3`. Only converted (Orbax) checkpoints load from a URL: a release's safetensors
shards are read with positioned reads of local files (`os.preadv`), which a URL does not give.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from etils import epath

from k3jax.checkpoint.safetensors_index import CheckpointError
from k3jax.config import ConfigError, K3Config

CheckpointPath = Path | epath.Path
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_MANGLED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")  # what pathlib makes of "gs://bucket"


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` is a URL (`scheme://...`) rather than a local path."""
    return bool(_URL.match(os.fspath(path)))


def checkpoint_path(path: str | os.PathLike) -> CheckpointPath:
    """A URL as an `epath.Path` (unchanged), a local path as an absolute `pathlib.Path`.

    A `pathlib.Path` made from a URL has lost a slash (`gs:/bucket`): that is refused, naming the fix,
    rather than read as a local folder called `gs:`."""
    text = os.fspath(path)
    if is_remote(text):
        return epath.Path(text)
    if isinstance(path, os.PathLike) and _MANGLED_URL.match(text):
        scheme = text.split(":", 1)[0]
        raise ValueError(f"{text!r} looks like a {scheme}:// URL that pathlib.Path has cut to one slash; "
                         f"pass the URL as a string ('{scheme}://{text.split(':/', 1)[1]}')")
    return Path(text).absolute()


def remote_is_file(path: epath.Path) -> bool:
    """`path.is_file()` for a URL; a storage that cannot be reached (or whose filesystem package is not
    installed, e.g. gcsfs for gs://) is a CheckpointError naming the URL."""
    try:
        return path.is_file()
    except Exception as err:  # any backend failure (missing package, credentials, network) is reported here
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {err}") from None


def read_json(path: CheckpointPath) -> dict[str, Any]:
    """A JSON object from a local or remote file; an error names the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def load_config(root: CheckpointPath, **overrides: Any) -> K3Config:
    """The checkpoint's config.json (local or remote) as a K3Config."""
    if isinstance(root, Path):
        return K3Config.from_hf(root, **overrides)
    if not remote_is_file(root / "config.json"):
        raise ConfigError(f"no config file at {root / 'config.json'}")
    return K3Config.from_hf(read_json(root / "config.json"), **overrides)
