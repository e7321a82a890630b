"""Full-scale rehearsal without the weights: the whole Kimi K3 release, headers only.

`fake_release.write_fake_release` writes the release's 96 shards with real tensor names, shapes and
dtypes and sparse (hole) bodies; `k3jax convert FAKE --plan-only --mesh expert=64,tensor=8` must map
every tensor (no missing, unexpected or mis-shaped one), keep the experts MXFP4-packed, map the
vision tower and projector, and report what each of the 512 devices would hold.
"""

from __future__ import annotations

import json
import re

import pytest

from k3jax.checkpoint import CheckpointIndex
from k3jax.cli import main
from tests.k3jax.convert.fake_release import NUM_SHARDS, release_tensors, write_fake_release

TB = 10**12


@pytest.fixture(scope="module")
def fake_release(tmp_path_factory):
    return write_fake_release(tmp_path_factory.mktemp("fake") / "Kimi-K3")


def test_fake_release_is_header_faithful_and_takes_no_disk(fake_release):
    shards = sorted(fake_release.glob("*.safetensors"))
    assert [s.name for s in shards] == [f"model-{i:05d}-of-000096.safetensors" for i in range(1, NUM_SHARDS + 1)]
    apparent = sum(s.stat().st_size for s in shards)
    allocated = sum(s.stat().st_blocks * 512 for s in shards)
    assert 1.4 * TB < apparent < 1.7 * TB and allocated < 300 * 2**20  # bodies are holes; headers only
    index = CheckpointIndex.open(fake_release)  # every header parses and matches the index
    names = index.names()
    assert len(names) == len(release_tensors(json.loads((fake_release / "config.json").read_text())))
    packed = index.info("language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight_packed")
    scale = index.info("language_model.model.layers.92.block_sparse_moe.experts.895.w2.weight_scale")
    assert (packed.shape, packed.dtype.name, scale.shape) == ((3584, 1536), "uint8", (3584, 96))
    assert index.info("language_model.model.layers.1.self_attn.A_log").shape == (128,)  # padded to head_dim
    assert index.info("vision_tower.encoder.blocks.26.wqkv.weight").shape == (4608, 1024)
    assert len({index.info(n).shard_path for n in names}) == NUM_SHARDS


def test_plan_only_maps_the_whole_release_and_reports_bytes_per_device(fake_release, capsys):
    assert main(["convert", str(fake_release), "--plan-only", "--mesh", "expert=64,tensor=8"]) == 0
    out = capsys.readouterr().out
    # embed, 93 layers, head, vision (27 blocks of 6 leaves, patch embedding, position table, final norm, 3 projector)
    assert "items: 96, leaves: 3180, largest item: layer_001" in out
    assert "language_model.model.layers.92.block_sparse_moe.experts.{0..895}.w3.weight_scale" in out
    assert "vision_tower.encoder.blocks.26.wqkv.weight" in out and "mm_projector.proj.2.weight" in out
    total = int(re.search(r"total: (\d+) bytes written", out).group(1))
    assert 1.4 * TB < total < 1.7 * TB  # experts at 4.25 bits/weight: the whole model fits ~1.5 TB
    line = next(line for line in out.splitlines() if line.startswith("mesh expert=64,tensor=8 (512 devices): "))
    per_device = int(re.search(r"\): (\d+) bytes", line).group(1))
    # the 2.6 T routed-expert weights are split 512 ways; everything else is replicated or split by tensor
    experts = 92 * 896 * 3 * 3072 * 3584 * 17 // 32  # 4.25 bits = 17/32 bytes per weight
    assert experts // 512 < per_device < experts // 512 + (total - experts)
    assert f"of {total} bytes" in line
