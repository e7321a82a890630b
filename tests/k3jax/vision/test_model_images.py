"""Images in the model's forward and in generation: a batch mixing text-only rows and rows with
several images gives each row what it gives alone, and generation with images continues exactly what
the teacher-forced forward predicts. The expanded layout itself (left padding, pad tokens, order of
images over rows) is checked on the host, without compiling.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import k3jax
from k3jax.config import K3Config
from k3jax.model import forward_images
from k3jax.vision.embed import prepare_images
from tests.conftest import GOLDEN_DIR, rel_rms

PLACEHOLDER = 277  # the golden config's media_placeholder_token_id
# Batch composition moves fp32 logits by ~3e-6 rel-RMS (other matmul shapes in the MoE dispatch, see
# tests/sharding); a misplaced image or a row attending to another's padding costs > 1e-2.
ROW_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def ref(golden_reference):
    return golden_reference("multimodal_fp32")


def two_image_row(ref) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The golden image and a small second one, both placeholders in one row of 12 tokens."""
    small = np.random.default_rng(3).uniform(-1, 1, (4, 3, 14, 14)).astype(np.float32)
    pixels = np.concatenate([ref["pixel_values"], small])
    grids = np.asarray([[1, 4, 6], [1, 2, 2]])
    ids = np.asarray([[3, 9, PLACEHOLDER, 40, 41, 42, 7, PLACEHOLDER, 8, 100, 101, 102]], np.int32)
    return ids, pixels, grids


def test_mixed_text_and_image_batch_equals_each_row_alone(golden_model_fp32, ref):
    model = golden_model_fp32
    ids, pixels, grids = two_image_row(ref)  # 12 tokens, expanded to 12 - 2 + 6 + 1 = 17 positions
    text = np.random.default_rng(4).integers(0, 256, (1, 12)).astype(np.int32)
    alone, start = forward_images(model, ids, pixels, grids)
    assert start is None and alone.shape == (1, 17, 512)
    text_alone = np.asarray(model(text))

    together, start = forward_images(model, np.concatenate([ids, text]), pixels, grids)
    assert together.shape == (2, 17, 512) and start.tolist() == [0, 5]  # the text row is left-padded
    assert rel_rms(together[0], alone[0]) < ROW_TOLERANCE
    assert rel_rms(together[1, 5:], text_alone[0]) < ROW_TOLERANCE



def test_generate_with_images_continues_the_teacher_forced_forward(golden_model_fp32, ref):
    ids, pixels, grids = ref["input_ids"], ref["pixel_values"], ref["grid_thws"]
    tokens = np.asarray(k3jax.generate(golden_model_fp32, ids, max_new_tokens=3, pixel_values=pixels,
                                       grid_thws=grids))
    logits, _ = forward_images(golden_model_fp32, np.concatenate([ids, tokens[:, :2]], 1), pixels, grids)
    np.testing.assert_array_equal(np.argmax(np.asarray(logits)[0, -3:], -1), tokens[0])
    first = np.argmax(ref["logits"][0, -1])
    assert tokens[0, 0] == first


def test_layout_expands_placeholders_in_order_and_keeps_left_padding():
    cfg = K3Config.from_hf(GOLDEN_DIR)
    model = SimpleNamespace(config=cfg, vision_tower=object())
    ids = np.asarray([[511, 511, 7, PLACEHOLDER], [PLACEHOLDER, 8, 511, PLACEHOLDER]], np.int32)
    grids = np.asarray([[1, 2, 2], [1, 4, 2], [1, 2, 4]])  # 1, 2 and 2 feature rows
    pixels = np.zeros((4 + 8 + 8, 3, 14, 14), np.float32)
    images, start = prepare_images(model, ids, np.asarray([2, 0]), pixels, grids)
    token, feature, zero = lambda b, t: b * 4 + t, lambda i: 8 + i, 8 + 5  # noqa: E731
    rows = np.asarray(images.gather)
    assert rows.shape == (2, 6) and start.tolist() == [4, 0]
    assert rows[0].tolist() == [zero] * 4 + [token(0, 2), feature(0)]
    # row 1: image 1 (two rows), token 8, a pad token inside the prompt (its embedding zeroed), image 2
    assert rows[1].tolist() == [feature(1), feature(2), token(1, 1), zero, feature(3), feature(4)]
    assert images.grids == ((1, 2, 2), (1, 4, 2), (1, 2, 4))
    text_only = dataclasses.replace(cfg, vision=None)
    with pytest.raises(ValueError, match="no vision tower"):
        prepare_images(SimpleNamespace(config=text_only, vision_tower=None), ids, None, pixels, grids)
