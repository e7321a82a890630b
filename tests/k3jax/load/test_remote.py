"""Converted checkpoints at a URL (`gs://bucket/...`) load through etils `epath`, Orbax's path type, with
the URL kept as given; release directories stay local.

The fake bucket is faithful where it can be without a network: `gs://` paths go through epath's real
fsspec backend to a registered fsspec filesystem that serves a local folder, and TensorStore (which
Orbax asks for the array data) gets a `file` kvstore for the same folder instead of its `gcs` one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.serialization import tensorstore_utils

import k3jax
from k3jax import cli
from k3jax.checkpoint import CheckpointError
from k3jax.convert import convert
from k3jax.load.paths import checkpoint_path, is_remote
from k3jax.tokenizer import TiktokenTokenizer, load_tokenizer
from tests.k3jax.test_tokenizer import _write_tokenizer_dir

fsspec_registry = importlib.import_module("fsspec.registry")  # the module: the package exports a read-only view


@pytest.mark.parametrize("given, remote, expected", [
    ("gs://bucket/kimi-k3", True, "gs://bucket/kimi-k3"),
    ("s3://bucket/a/b/", True, "s3://bucket/a/b"),
    (epath.Path("gs://bucket/kimi-k3"), True, "gs://bucket/kimi-k3"),
    ("relative/dir", False, os.path.join(os.getcwd(), "relative/dir")),
    (Path("relative/dir"), False, os.path.join(os.getcwd(), "relative/dir")),
    ("/abs/gs://x", False, "/abs/gs:/x"),  # a local path that merely contains "://"
])
def test_paths_are_classified_and_urls_kept(given, remote, expected):
    assert is_remote(given) is remote
    path = checkpoint_path(given)
    assert str(path) == expected and isinstance(path, epath.Path if remote else Path)


def test_a_url_cut_by_pathlib_is_refused():
    with pytest.raises(ValueError, match=r"'gs:/bucket/k3' looks like a gs:// URL that pathlib.Path has cut to one "
                                         r"slash; pass the URL as a string \('gs://bucket/k3'\)"):
        checkpoint_path(Path("gs://bucket/k3"))


class _FakeBucket(LocalFileSystem):
    """gs://<path> served from `<root>/<path>` (fsspec's local filesystem under another protocol)."""

    protocol = ("gcs", "gs")
    root = Path("/nonexistent")

    def __init__(self, *args, finalize_on_close: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return str(cls.root / path[len(prefix):]).rstrip("/")
        return super()._strip_protocol(path)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A local folder that `gs://...` URLs reach, for epath (fsspec) and for Orbax's TensorStore reads."""
    root = tmp_path / "bucket"
    root.mkdir()
    monkeypatch.setattr(_FakeBucket, "root", root)
    for protocol in _FakeBucket.protocol:  # undone after the test, as is epath's cache of filesystems
        monkeypatch.setitem(fsspec_registry._registry, protocol, _FakeBucket)
    monkeypatch.setattr(epath.gpath, "_is_tf_installed", lambda: False)  # epath's fsspec backend, whatever is installed
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()

    def local_kvstore(url: str) -> dict:
        assert url.startswith("gs://"), url
        return {"driver": "file", "path": str(root / url[len("gs://"):])}

    monkeypatch.setattr(tensorstore_utils, "_get_kvstore_for_gcs", local_kvstore)
    yield root
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()


@pytest.fixture
def remote_conversion(bucket, tmp_path, golden_dir):
    """The golden release with tokenizer files, converted into the bucket as gs://models/k3."""
    release = tmp_path / "release"
    shutil.copytree(golden_dir, release, ignore=shutil.ignore_patterns("reference", "README.md"))
    n = _write_tokenizer_dir(release)
    convert(release, bucket / "models" / "k3", dtype="float32", progress=False)
    return "gs://models/k3", n


def test_from_pretrained_loads_a_converted_checkpoint_from_a_url(remote_conversion, bucket, golden_dir):
    url, _ = remote_conversion
    remote = k3jax.from_pretrained(url, dtype="float32", verify=True)
    local = k3jax.from_pretrained(bucket / "models" / "k3", dtype="float32")
    for a, b in zip(jax.tree.leaves(remote), jax.tree.leaves(local), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(load_tokenizer(url), TiktokenTokenizer)


def test_generate_command_reads_a_url(remote_conversion, monkeypatch, capsys):
    url, n = remote_conversion
    seen = {}

    def fake_generate(model, ids, *, on_token, **kwargs):  # the model loads for real; generation is skipped
        seen["model"], seen["ids"] = model, np.asarray(ids)[0].tolist()
        on_token(np.asarray([256 + 6], np.int32))

    monkeypatch.setattr(cli, "generate", fake_generate)
    assert cli.main(["generate", "--model", url, "--prompt", "hello", "--dtype", "float32"]) == 0
    assert seen["ids"] == [n, 256 + 6] and isinstance(seen["model"], k3jax.K3Model)
    out, err = capsys.readouterr()
    assert out == "hellohello\n" and "warning" not in err


def test_a_release_at_a_url_is_refused_with_the_way_out(bucket, golden_dir):
    shutil.copytree(golden_dir, bucket / "Kimi-K3", ignore=shutil.ignore_patterns("reference"))
    with pytest.raises(CheckpointError, match=r"gs://Kimi-K3 has no manifest.json: only `k3jax convert` outputs load "
                                              r"from remote storage; convert the release into a local directory"):
        k3jax.from_pretrained("gs://Kimi-K3")


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs installed: it would go online")
def test_unreachable_storage_is_a_checkpoint_error():
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    with pytest.raises(CheckpointError, match=r"cannot read gs://no-such-bucket/k3/manifest.json: ImportError"):
        k3jax.from_pretrained("gs://no-such-bucket/k3")
