"""Hostile or broken releases: a one-line error naming the file or tensor, exit status 1, never COMPLETE."""

from __future__ import annotations

import re
import shutil

import ml_dtypes
import numpy as np
import pytest

import k3jax
from k3jax.checkpoint import CheckpointError
from k3jax.checkpoint.store import COMPLETE, MANIFEST
from k3jax.checkpoint.transform import _all_finite, _decode_pair
from k3jax.cli import main
from tests.conftest import write_variant
from tests.k3jax.convert.conftest import run_cli

Q_PROJ = "language_model.model.layers.2.self_attn.q_proj.weight"
EXPERT = "language_model.model.layers.3.block_sparse_moe.experts.5.w1"


def test_corrupt_shard_header_exits_nonzero_from_the_command_line(tmp_path, golden_dir):
    source = tmp_path / "hf"
    shutil.copytree(golden_dir, source, ignore=shutil.ignore_patterns("reference", "README.md"))
    shard = source / "model-00002-of-000003.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated in the middle of its header

    done = run_cli("convert", source, tmp_path / "out", "--quiet")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "model-00002-of-000003.safetensors" in done.stderr
    assert "runs past the end of the file" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not (tmp_path / "out").exists()


def _poisoned(tensors: dict, name: str, value: float) -> dict:
    array = tensors[name].astype(np.float32)
    array[7, 3] = value
    return {**tensors, name: array.astype(ml_dtypes.bfloat16)}


def _scaled(tensors: dict, scale_byte: int) -> dict:
    scale = tensors[f"{EXPERT}.weight_scale"].copy()
    packed = tensors[f"{EXPERT}.weight_packed"].copy()
    scale[2, 1], packed[2, 16] = scale_byte, 0x77  # 6.0 * 2^127 overflows float32
    return {**tensors, f"{EXPERT}.weight_scale": scale, f"{EXPERT}.weight_packed": packed}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: _poisoned(t, Q_PROJ, np.nan), f"tensor {Q_PROJ} holds 1 NaN and 0 inf value\\(s\\).*\\[7, 3\\]"),
        (lambda t: _poisoned(t, Q_PROJ, -np.inf), f"tensor {Q_PROJ} holds 0 NaN and 1 inf value\\(s\\)"),
        (lambda t: _scaled(t, 254), f"tensor {EXPERT}.weight_packed / {EXPERT}.weight_scale holds 0 NaN and \\d+ inf"),
        (lambda t: _scaled(t, 255), f"tensors {EXPERT}.weight_packed / {EXPERT}.weight_scale: .*NaN byte 255"),
    ],
    ids=["nan", "inf", "mxfp4-overflow", "mxfp4-nan-scale"],
)
def test_non_finite_weights_are_reported_by_tensor_name(tmp_path, golden_dir, golden_tensors, capsys, edit, message):
    source = write_variant(tmp_path / "hf", golden_dir, edit(golden_tensors))
    out = tmp_path / "out"
    assert main(["convert", str(source), str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert re.search(message, err), err
    assert (out / MANIFEST).is_file() and not (out / COMPLETE).exists()
    with pytest.raises(CheckpointError, match="incomplete conversion"):
        k3jax.from_pretrained(out)
    with pytest.raises(CheckpointError, match=message):
        k3jax.from_pretrained(source)  # the direct loader shares the check


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64])
def test_finite_check_on_the_bits_agrees_with_isfinite(dtype):
    values = np.random.default_rng(0).standard_normal(300_001).astype(dtype)
    assert _all_finite(values) and _all_finite(values[::2])
    for bad in (np.nan, np.inf, -np.inf):
        poisoned = values.copy()
        poisoned[299_999] = bad
        assert not _all_finite(poisoned) and not _all_finite(poisoned.reshape(1, -1))


def test_table_decode_reports_blocks_that_overflow():
    packed, scale = np.full((2, 16), 0x77, np.uint8), np.full((2, 1), 127, np.uint8)  # codes 6.0, factor 1
    assert _decode_pair(("p", "s"), packed, scale, np.dtype(np.float32)).max() == 6.0
    scale[1, 0] = 254  # 6.0 * 2^127 overflows float32
    with pytest.raises(CheckpointError, match=r"tensor p / s holds 0 NaN and 32 inf value\(s\).*\[1, 0\]"):
        _decode_pair(("p", "s"), packed, scale, np.dtype(ml_dtypes.bfloat16))
