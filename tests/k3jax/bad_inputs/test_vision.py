"""Bad images, grids and image files are errors naming what is wrong, raised before anything compiles.
One row per case; the model's jitted image forward is replaced by a recorder, so a check that fires
too late fails the test.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from k3jax.config import ConfigError, K3Config
from k3jax.vision.processor import load_image, process_images, resize_plan
from tests.conftest import GOLDEN_DIR

model_module = importlib.import_module("k3jax.model")
PLACEHOLDER = 277
IDS = np.asarray([[5, PLACEHOLDER, 6]], np.int32)
GRIDS = np.asarray([[1, 2, 2]])
PIXELS = np.zeros((4, 3, 14, 14), np.float32)


@pytest.fixture(scope="module")
def tiny_model():
    """The golden config with random weights (nothing here runs it)."""
    from flax import nnx

    cfg = K3Config.from_hf(GOLDEN_DIR, dtype="float32")
    return nnx.eval_shape(lambda: model_module.K3Model.init(cfg))


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the image forward was reached: a check fired too late")
    monkeypatch.setattr(model_module, "_forward_images", refuse)


CASES = [
    (dict(grid_thws=np.asarray([[1, 3, 2]])), "h and w must be even"),
    (dict(grid_thws=np.asarray([[5, 2, 2]])), "t must lie in \\[1, 4\\]"),
    (dict(grid_thws=np.asarray([[1, 2, 1024]])), "h and w must be even patch counts in \\[2, 512\\]"),
    (dict(grid_thws=np.asarray([1, 2, 2])), "grid_thws must be integers \\[num_images, 3\\]"),
    (dict(grid_thws=np.asarray([[1.0, 2.0, 2.0]])), "grid_thws must be integers"),
    (dict(pixel_values=np.zeros((5, 3, 14, 14), np.float32)), "pixel_values must be floats of shape \\[4, 3, 14, 14\\]"),
    (dict(pixel_values=np.zeros((4, 3, 14, 14), np.int32)), "pixel_values must be floats"),
    (dict(pixel_values=np.full((4, 3, 14, 14), np.nan, np.float32)), "NaN or inf"),
    (dict(pixel_values=None), "both pixel_values and grid_thws"),
    (dict(input_ids=np.asarray([[5, 6, 7]])), "hold 0 image placeholder\\(s\\).*but 1 image"),
    (dict(input_ids=np.asarray([[PLACEHOLDER, 6, PLACEHOLDER]])), "hold 2 image placeholder\\(s\\).*but 1 image"),
]


@pytest.mark.parametrize(("change", "message"), CASES, ids=[m[:30] for _, m in CASES])
def test_bad_images_name_the_problem(tiny_model, no_compile, change, message):
    args = {"input_ids": IDS, "pixel_values": PIXELS, "grid_thws": GRIDS, **change}
    with pytest.raises(ValueError, match=message):
        model_module.forward_images(tiny_model, **args)


def test_a_text_only_model_refuses_images(tiny_model, no_compile):
    text_only = dataclasses.replace(tiny_model.config, vision=None)
    from flax import nnx

    model = nnx.eval_shape(lambda: model_module.K3Model.init(text_only))
    assert model.vision_tower is None
    with pytest.raises(ValueError, match="no vision tower.*text-only"):
        model(IDS, pixel_values=PIXELS, grid_thws=GRIDS)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda v: v.update(merge_kernel_size=[3, 3]), "merge_kernel_size=\\[3, 3\\] is not supported"),
    (lambda v: v.update(pos_emb_interpolation_mode="bicubic"), "pos_emb_interpolation_mode='bicubic'"),
    (lambda v: v.update(qkv_hidden_size=90), "qkv_hidden_size=90"),
    (lambda v: v.update(text_hidden_size=64), "text_hidden_size must equal"),
    (lambda v: v.pop("vt_num_hidden_layers"), "vision_config.vt_num_hidden_layers is missing"),
])
def test_bad_vision_configs_name_the_key(edit, message):
    import json

    raw = json.loads((GOLDEN_DIR / "config.json").read_text())
    edit(raw["vision_config"])
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf(raw)


def test_image_files_that_cannot_be_read_name_the_path(tmp_path):
    garbage = tmp_path / "broken.png"
    garbage.write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match=f"cannot decode image file {garbage}"):
        load_image(garbage)
    with pytest.raises(FileNotFoundError, match="missing.jpg does not exist"):
        process_images([tmp_path / "missing.jpg"])
    with pytest.raises(ValueError, match="clip.MP4: video is not supported"):
        process_images([tmp_path / "clip.MP4"])


@pytest.mark.parametrize(("images", "message"), [
    ([], "non-empty list"), ("photo.jpg", "non-empty list"), ([np.zeros((4, 4, 3))], "expected a PIL image"),
])
def test_bad_image_lists(images, message):
    with pytest.raises((ValueError, TypeError), match=message):
        process_images(images)


@pytest.mark.parametrize("size", [(0, 5), (5, -1), (2.5, 3), (True, 3)])
def test_bad_image_sizes(size):
    with pytest.raises(ValueError, match="expected positive integers"):
        resize_plan(*size)
