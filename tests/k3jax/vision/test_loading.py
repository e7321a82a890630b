"""Which checkpoints load with a vision tower, and the vision tensors' names (no tensor data read)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from k3jax.checkpoint.names import VISION, model_slots, release_name
from k3jax.checkpoint.release_plan import text_only_without_vision
from k3jax.config import K3Config
from tests.conftest import GOLDEN_DIR


def fake_index(names: list[str]) -> SimpleNamespace:
    return SimpleNamespace(names=lambda: names, directory=GOLDEN_DIR)


def test_a_release_without_vision_tensors_loads_text_only_and_says_so():
    cfg = K3Config.from_hf(GOLDEN_DIR)
    with pytest.warns(UserWarning, match="no vision_tower.* tensors: loading a text-only model"):
        assert text_only_without_vision(cfg, fake_index(["language_model.lm_head.weight"])).vision is None
    with_tower = fake_index(["language_model.lm_head.weight", "vision_tower.patch_embed.proj.weight"])
    assert text_only_without_vision(cfg, with_tower) == cfg
    no_config = dataclasses.replace(cfg, vision=None)
    with pytest.warns(UserWarning, match="holds vision tensors but config.json has no vision_config"):
        assert text_only_without_vision(no_config, with_tower) == no_config


def test_vision_leaves_keep_their_release_names():
    (slot,) = model_slots(["vision_tower", "encoder", "blocks", 3, "wqkv", "weight"], plan=None)
    assert (slot.item, release_name(slot)) == (VISION, "vision_tower.encoder.blocks.3.wqkv.weight")
    (slot,) = model_slots(["mm_projector", "proj", 2, "weight"], plan=None)
    assert release_name(slot) == "mm_projector.proj.2.weight"
