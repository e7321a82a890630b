"""`k3jax convert` copies the release's config and tokenizer files into its output, so the output
tokenizes on its own; the copies are checksummed, verified, copied again on resume, and never
written through (or read through) a link that leaves their directory."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

import k3jax
from k3jax import cli
from k3jax.checkpoint import CheckpointError
from k3jax.checkpoint.store import MANIFEST
from k3jax.convert import convert
from k3jax.convert.text_files import TEXT_FILES, check_text_files
from k3jax.tokenizer import TiktokenTokenizer, load_tokenizer
from tests.k3jax.test_tokenizer import _write_tokenizer_dir

EXTRA = {"special_tokens_map.json": '{"bos_token": "[BOS]"}', "generation_config.json": '{"max_length": 8}'}


@pytest.fixture
def release(tmp_path, golden_dir):
    """The golden release with Kimi-format tokenizer files and the other text files a release ships."""
    path = tmp_path / "release"
    shutil.copytree(golden_dir, path, ignore=shutil.ignore_patterns("reference", "README.md"))
    n = _write_tokenizer_dir(path)
    for name, text in EXTRA.items():
        (path / name).write_text(text)
    return path, n


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_converted_directory_tokenizes_on_its_own(release, tmp_path, monkeypatch, capsys):
    source, n = release
    out = convert(source, tmp_path / "out", progress=False).out_dir
    copied = ["config.json", "tiktoken.model", "tokenizer_config.json", *EXTRA]
    assert set(TEXT_FILES) >= set(copied)
    recorded = json.loads((out / MANIFEST).read_text())["text_files"]
    assert recorded == {name: _sha256(source / name) for name in copied}
    for name in copied:
        assert (out / name).read_bytes() == (source / name).read_bytes() and not (out / name).is_symlink()
    tokenizer = load_tokenizer(out)
    assert isinstance(tokenizer, TiktokenTokenizer) and tokenizer.bos_id == n
    assert tokenizer.encode("hello the world") == load_tokenizer(source).encode("hello the world")

    seen = {}

    def fake_generate(model, ids, *, on_token, **kwargs):  # the real model loads; only generation is skipped
        seen["model"], seen["ids"] = model, np.asarray(ids)[0].tolist()
        on_token(np.asarray([256 + 6], np.int32))  # b"hello" in the test tokenizer

    monkeypatch.setattr(cli, "generate", fake_generate)
    assert cli.main(["generate", "--model", str(out), "--prompt", "hello the world", "--bos"]) == 0
    assert seen["ids"] == [n, *tokenizer.encode("hello the world")]
    out_text, err = capsys.readouterr()
    assert out_text == "hello the worldhello\n" and "warning" not in err  # the BPE tokenizer, no byte fallback
    assert isinstance(seen["model"], k3jax.K3Model)
    k3jax.from_pretrained(out, verify=True)  # the copies match the manifest


def test_resume_copies_again_and_verify_finds_a_changed_copy(release, tmp_path):
    source, _ = release
    out = tmp_path / "out"
    convert(source, out, progress=False)
    good = (out / "tiktoken.model").read_bytes()
    (out / "tiktoken.model").write_text("YQ== 0\n")
    with pytest.raises(CheckpointError, match=rf"{out / 'tiktoken.model'} has sha256 [0-9a-f]+, the manifest"):
        k3jax.from_pretrained(out, verify=True)
    manifest = json.loads((out / MANIFEST).read_text())
    with pytest.raises(CheckpointError, match=r"tiktoken.model has sha256 .*; `k3jax convert --resume` copies it"):
        check_text_files(out, source, manifest)  # what --verify runs
    (out / "tiktoken.model").write_bytes(good)
    (out / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{out / 'generation_config.json'} is missing"):
        k3jax.from_pretrained(out, verify=True)

    (source / "generation_config.json").unlink()  # the release changed its text files meanwhile
    result = convert(source, out, resume=True, progress=False)
    assert result.written == 0
    assert (out / "tiktoken.model").read_bytes() == (source / "tiktoken.model").read_bytes()
    assert "generation_config.json" not in json.loads((out / MANIFEST).read_text())["text_files"]
    assert not (out / "generation_config.json").exists()
    assert not list(out.glob(".*.tmp"))
    check_text_files(out, source, json.loads((out / MANIFEST).read_text()))
    (source / "tiktoken.model").write_text("YQ== 0\n")
    with pytest.raises(CheckpointError, match=rf"{out / 'tiktoken.model'} differs from {source / 'tiktoken.model'}"):
        check_text_files(out, source, json.loads((out / MANIFEST).read_text()))


def test_release_without_tokenizer_files_copies_its_config(tmp_path, golden_dir):
    out = convert(golden_dir, tmp_path / "out", progress=False).out_dir
    assert json.loads((out / MANIFEST).read_text())["text_files"] == {"config.json": _sha256(golden_dir / "config.json")}


def test_output_text_file_that_is_a_link_is_refused(release, tmp_path):
    source, _ = release
    out = tmp_path / "out"
    convert(source, out, progress=False)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (out / "tokenizer_config.json").unlink()
    (out / "tokenizer_config.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json is a symbolic link; a conversion output must"):
        convert(source, out, resume=True, progress=False)
    assert outside.read_text() == "keep me"


def test_release_text_file_linked_out_of_the_release_is_refused(release, tmp_path):
    source, _ = release
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (source / "special_tokens_map.json").unlink()
    (source / "special_tokens_map.json").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"special_tokens_map.json is a link to .*elsewhere.json, outside"):
        convert(source, tmp_path / "out", progress=False)
    (source / "special_tokens_map.json").unlink()
    (source / "special_tokens_map.json").symlink_to("generation_config.json")  # a link inside the release is read
    out = convert(source, tmp_path / "out2", progress=False).out_dir
    assert not (out / "special_tokens_map.json").is_symlink()
    assert (out / "special_tokens_map.json").read_text() == EXTRA["generation_config.json"]
