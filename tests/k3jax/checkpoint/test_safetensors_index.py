"""CheckpointIndex on the golden k3-tiny-a release layout and on deliberately corrupt files."""

import json
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from k3jax.checkpoint import CheckpointError, CheckpointIndex
from pallas_kernels.mxfp4 import decode_mxfp4, encode_mxfp4
from tests.conftest import GOLDEN_DIR

REPO = Path(__file__).resolve().parents[3]
PREFIX = "language_model.model.layers"
KDA_LAYERS = [0, 1, 2, 4, 5, 6, 8, 9, 10]


def golden_dir() -> Path:
    return GOLDEN_DIR


@pytest.fixture(scope="module")
def golden() -> CheckpointIndex:
    return CheckpointIndex.open(golden_dir())


# ---------------------------------------------------------------------------- golden checkpoint


def test_golden_opens_and_every_tensor_reads(golden):
    names = golden.names()
    weight_map = json.loads((golden_dir() / "model.safetensors.index.json").read_text())["weight_map"]
    assert names == sorted(weight_map) and len(names) == 1510
    for name in names:
        info = golden.info(name)
        array = golden.read(name)
        assert array.shape == info.shape and array.dtype == info.dtype
        assert info.shard_path.name == weight_map[name]


def test_golden_matches_safetensors_library(golden):
    by_shard: dict[Path, list[str]] = {}
    for name in golden.names():
        by_shard.setdefault(golden.info(name).shard_path, []).append(name)
    assert len(by_shard) == 3
    for shard, names in by_shard.items():
        with safe_open(str(shard), framework="numpy") as f:
            assert sorted(f.keys()) == names
            for name in names:
                ours, theirs = golden.read(name), f.get_tensor(name)
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
                assert ours.tobytes() == theirs.tobytes(), name


def test_golden_dtypes(golden):
    embed = golden.read("language_model.model.embed_tokens.weight")
    assert embed.dtype == ml_dtypes.bfloat16 and embed.shape == (512, 128)
    assert golden.read(f"{PREFIX}.0.self_attn.dt_bias").dtype == np.float32
    fp32 = re.compile(r"\.(self_attn\.(A_log|dt_bias|[qkv]_conv1d\.weight|o_norm\.weight)"
                      r"|block_sparse_moe\.gate\.e_score_correction_bias)$")
    u8 = re.compile(r"\.experts\.\d+\.w[123]\.weight_(packed|scale)$")
    for name in golden.names():
        expected = (np.float32 if fp32.search(name)
                    else np.uint8 if u8.search(name) else ml_dtypes.bfloat16)
        assert golden.info(name).dtype == expected, name


def test_golden_layer5_experts_straddle_shards(golden):
    shards: dict[int, set[str]] = {}
    for name in golden.names():
        m = re.match(rf"{PREFIX}\.5\.block_sparse_moe\.experts\.(\d+)\.", name)
        if m:
            shards.setdefault(int(m.group(1)), set()).add(golden.info(name).shard_path.name)
    assert sorted(shards) == list(range(16))
    assert all(len(s) == 1 for s in shards.values())  # one expert's six tensors stay together
    assert set.union(*shards.values()) == {
        "model-00001-of-000003.safetensors", "model-00002-of-000003.safetensors"}


def test_golden_a_log_padding(golden):
    for layer in KDA_LAYERS:
        a_log = golden.read(f"{PREFIX}.{layer}.self_attn.A_log")
        assert a_log.shape == (32,)
        assert np.all(a_log[4:] == 0) and np.all(a_log[:4] > 0)


def test_golden_expert_decodes_and_reencodes(golden):
    w1 = f"{PREFIX}.5.block_sparse_moe.experts.10.w1"
    w = decode_mxfp4(golden.read(f"{w1}.weight_packed"), golden.read(f"{w1}.weight_scale"))
    assert w.shape == (64, 64) and w.dtype == np.float32
    assert np.all(np.isfinite(w)) and np.any(w != 0)
    # Every expert was made by the OCP quantiser, so re-encoding its values reproduces the bytes.
    for name in golden.names():
        if name.endswith(".weight_packed"):
            packed, scale = golden.read(name), golden.read(name.replace("_packed", "_scale"))
            again = encode_mxfp4(decode_mxfp4(packed, scale))
            assert np.array_equal(again[0], packed) and np.array_equal(again[1], scale), name


@pytest.mark.parametrize(
    "index",
    [np.s_[2:5], np.s_[::3], np.s_[-1], np.s_[5:1:-2], np.s_[::-1], np.s_[3:3], np.s_[7, 10:20],
     np.s_[1:4, ::2], np.s_[-3:, ..., 5], ()],
)
def test_golden_read_slice(golden, index):
    name = "language_model.model.layers.3.self_attn.q_b_proj.weight"
    assert np.array_equal(golden.read_slice(name, index), golden.read(name)[index])


def test_read_slice_rejects_bad_indices(golden):
    name = "language_model.model.norm.weight"
    with pytest.raises(IndexError, match="out of bounds"):
        golden.read_slice(name, 128)
    with pytest.raises(IndexError, match="int or a slice"):
        golden.read_slice(name, [0, 1])


def test_unknown_tensor(golden):
    assert "nope" not in golden and "language_model.lm_head.weight" in golden
    with pytest.raises(CheckpointError, match="'nope'.*no such tensor"):
        golden.info("nope")


# ---------------------------------------------------------------------------- synthetic files


def write_raw(path: Path, header, data: bytes, header_len: int | None = None) -> Path:
    """A shard with an arbitrary header (dict -> JSON, or raw bytes) and data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def f32_entry(shape, begin, end) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def sharded(tmp_path: Path, shards: dict[str, dict[str, np.ndarray]]) -> Path:
    """Shards written by the safetensors library, with a consistent index."""
    for shard, tensors in shards.items():
        save_file(tensors, str(tmp_path / shard))
    write_index(tmp_path, {n: shard for shard, tensors in shards.items() for n in tensors})
    return tmp_path


def test_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal(7).astype(np.float16),
        "f64": rng.standard_normal((2, 2, 2)),
        "u8": rng.integers(0, 256, (6, 3), dtype=np.uint8),
        "i32": rng.integers(-9, 9, 5, dtype=np.int32),
        "i64": rng.integers(-9, 9, (1, 4), dtype=np.int64),
        "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }
    ckpt = sharded(tmp_path, {"a.safetensors": dict(list(tensors.items())[:5]),
                              "b.safetensors": dict(list(tensors.items())[5:])})
    index = CheckpointIndex.open(ckpt)
    assert index.names() == sorted(tensors)
    for name, expected in tensors.items():
        got = index.read(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes()
        got.flat[:1] = 0  # results are writable copies, not views of a read-only buffer


def test_float8_tensor(tmp_path):
    values = np.array([[0.5, -2.0], [448.0, 0.0]], ml_dtypes.float8_e4m3fn)
    write_raw(tmp_path / "model.safetensors",
              {"x": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}}, values.tobytes())
    got = CheckpointIndex.open(tmp_path).read("x")
    assert got.dtype == ml_dtypes.float8_e4m3fn and np.array_equal(got, values)


def test_single_file_without_index(tmp_path):
    save_file({"w": np.arange(12, dtype=np.float32).reshape(4, 3)}, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex.open(tmp_path)
    assert index.names() == ["w"] and index.read_slice("w", 2).tolist() == [6.0, 7.0, 8.0]


def test_read_slice_reads_only_the_rows_it_needs(tmp_path):
    w = np.arange(40, dtype=np.float32).reshape(10, 4)
    shard = tmp_path / "model.safetensors"
    save_file({"w": w}, str(shard))
    index = CheckpointIndex.open(tmp_path)
    with shard.open("r+b") as f:  # cut the last 3 rows after the header was checked
        f.truncate(shard.stat().st_size - 3 * 16)
    assert np.array_equal(index.read_slice("w", np.s_[1:6:2]), w[1:6:2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'w': read 112 of 160 bytes"):
        index.read("w")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor"):
        CheckpointIndex.open(tmp_path)


def test_truncated_shard(tmp_path):
    shard = tmp_path / "model.safetensors"
    save_file({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, str(shard))
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'b': .*run past the end "
                       r"of the data section \(26 bytes; file truncated\?\)"):
        CheckpointIndex.open(tmp_path)


def test_header_length_past_eof(tmp_path):
    write_raw(tmp_path / "model.safetensors", {}, b"", header_len=10**6)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header length 1000000 runs past "
                       r"the end of the file \(10 bytes\)"):
        CheckpointIndex.open(tmp_path)


def test_file_shorter_than_header_length_field(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="2 bytes, too short"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_header_not_json_object(tmp_path, header):
    write_raw(tmp_path / "model.safetensors", header, b"")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header (is not valid JSON|must be "
                       r"a JSON object)"):
        CheckpointIndex.open(tmp_path)


def test_duplicate_key_in_header(tmp_path):
    entry = json.dumps(f32_entry([1], 0, 4))
    write_raw(tmp_path / "model.safetensors", f'{{"x": {entry}, "x": {entry}}}'.encode(), bytes(4))
    with pytest.raises(CheckpointError, match="header lists 'x' more than once"):
        CheckpointIndex.open(tmp_path)


def test_overlapping_offsets(tmp_path):
    header = {"a": f32_entry([4], 0, 16), "b": f32_entry([4], 8, 24)}
    write_raw(tmp_path / "model.safetensors", header, bytes(24))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'b': bytes .* overlap "
                       r"tensor 'a'"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize(
    "entry, match",
    [
        (f32_entry([4], 16, 32), r"data_offsets \[16, 32\] run past the end of the data section "
                                 r"\(16 bytes"),
        (f32_entry([4], 16, 0), r"data_offsets must be \[begin, end\] .* got \[16, 0\]"),
        (f32_entry([4], -4, 12), r"got \[-4, 12\]"),
        (f32_entry([4], 0, 12), r"span 12 bytes but F32 \[4\] needs 16"),
        (f32_entry([-4], 0, 16), r"shape must be a list of non-negative ints"),
        ({"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}, r"unsupported dtype 'Q7'"),
        ({"dtype": "F32", "shape": [4]}, r"must have dtype, shape, data_offsets"),
    ],
)
def test_bad_entries(tmp_path, entry, match):
    write_raw(tmp_path / "model.safetensors", {"t": entry}, bytes(16))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 't': .*" + match):
        CheckpointIndex.open(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path):
    sharded(tmp_path, {"s1.safetensors": {"x": np.ones(2, np.float32)},
                       "s2.safetensors": {"x": np.ones(2, np.float32), "y": np.ones(1, np.float32)}})
    write_index(tmp_path, {"x": "s1.safetensors", "y": "s2.safetensors"})
    with pytest.raises(CheckpointError, match=r"s2\.safetensors: tensor 'x': duplicate tensor, also "
                       r"stored in .*s1\.safetensors"):
        CheckpointIndex.open(tmp_path)


def test_index_points_at_missing_file(tmp_path):
    sharded(tmp_path, {"s1.safetensors": {"x": np.ones(2, np.float32)}})
    write_index(tmp_path, {"x": "s1.safetensors", "y": "gone.safetensors"})
    with pytest.raises(CheckpointError, match=r"index\.json: maps tensors \(e\.g\. 'y'\) to "
                       r"'gone\.safetensors', but .*gone\.safetensors does not exist"):
        CheckpointIndex.open(tmp_path)


def test_index_name_missing_in_shard(tmp_path):
    sharded(tmp_path, {"s1.safetensors": {"x": np.ones(2, np.float32)},
                       "s2.safetensors": {"y": np.ones(2, np.float32)}})
    write_index(tmp_path, {"x": "s1.safetensors", "y": "s2.safetensors", "ghost": "s1.safetensors"})
    with pytest.raises(CheckpointError, match=r"s1\.safetensors: tensor 'ghost': listed in "
                       r"model\.safetensors\.index\.json for this shard, but the shard's header"):
        CheckpointIndex.open(tmp_path)


def test_index_maps_tensor_to_wrong_shard(tmp_path):
    sharded(tmp_path, {"s1.safetensors": {"x": np.ones(2, np.float32)},
                       "s2.safetensors": {"y": np.ones(2, np.float32)}})
    write_index(tmp_path, {"x": "s2.safetensors", "y": "s2.safetensors"})
    with pytest.raises(CheckpointError, match=r"s2\.safetensors: tensor 'x': listed in"):
        CheckpointIndex.open(tmp_path)


def test_shard_tensor_missing_from_index(tmp_path):
    sharded(tmp_path, {"s1.safetensors": {"x": np.ones(2, np.float32), "extra": np.ones(1, np.uint8)}})
    write_index(tmp_path, {"x": "s1.safetensors"})
    with pytest.raises(CheckpointError, match=r"s1\.safetensors: tensor 'extra': stored in this shard "
                       r"but not listed in .*index\.json"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"weight_map": {"x": "a"', "index is not valid JSON"),
        ('{"metadata": {}}', "expected a JSON object with a 'weight_map'"),
        ('{"weight_map": {"x": 3}}', "expected a JSON object with a 'weight_map'"),
        ('{"weight_map": {"x": "a", "x": "b"}}', "index lists 'x' more than once"),
    ],
)
def test_bad_index(tmp_path, text, match):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: " + match):
        CheckpointIndex.open(tmp_path)
