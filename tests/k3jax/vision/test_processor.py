"""Image processing against the release processor's rules: the resize rule and pixel budget on odd
sizes (1x1, huge, 1x5000), bicubic resize, bottom/right black padding, mean/std, patch order,
transparency onto the chessboard, EXIF orientation, and the prompt text.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from k3jax.vision.processor import (
    ProcessorConfig, image_prompt_ids, image_prompt_text, load_image, process_image, process_images, resize_plan,
)

# (width, height) -> grid (1, rows, columns) and tokens; the first three are the release processor's own examples
PLANS = [
    ((448, 448), (1, 32, 32), 256),
    ((4000, 3000), (1, 216, 286), 15444),
    ((3585, 3585), (1, 258, 258), 16641),
    ((1, 1), (1, 2, 2), 1),
    ((1, 5000), (1, 358, 2), 179),
    ((5000, 1), (1, 2, 358), 179),
    ((20000, 20000), (1, 258, 258), 16641),  # shrunk to the ~65K patch budget
    ((1, 100000), (1, 512, 2), 256),  # shrunk to 512 patches on the long side
    ((30, 17), (1, 2, 4), 2),
]


@pytest.mark.parametrize(("size", "grid", "tokens"), PLANS, ids=[f"{w}x{h}" for (w, h), _, _ in PLANS])
def test_resize_rule(size, grid, tokens):
    plan = resize_plan(*size)
    assert (plan.grid, plan.num_tokens) == (grid, tokens)


def test_resize_rule_properties_over_many_sizes():
    rng = np.random.default_rng(0)
    for width, height in rng.integers(1, 30000, (300, 2)).tolist():
        plan = resize_plan(width, height)
        assert plan.width <= width and plan.height <= height  # never upscales
        assert plan.width / width == pytest.approx(plan.height / height, abs=2 / min(width, height) + 1e-9) or \
            min(plan.width, plan.height) == 1  # the aspect ratio is kept
        _, rows, cols = plan.grid
        assert rows % 2 == cols % 2 == 0 and rows <= 512 and cols <= 512
        assert plan.num_tokens < 17000  # the ~65K-patch budget, padding included, tops out below 17K tokens
        assert 0 <= plan.pad_width < 28 and (plan.width + plan.pad_width) == cols * 14


def normalised(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) / 255.0 * 2.0 - 1.0


def unpatchify(patches: np.ndarray, grid) -> np.ndarray:
    """[rows*cols, 3, 14, 14] -> [rows*14, cols*14, 3], patch (r, c) at row-major index r*cols + c."""
    _, rows, cols = grid
    out = np.empty((rows * 14, cols * 14, 3), np.float32)
    for r in range(rows):
        for c in range(cols):
            out[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14] = patches[r * cols + c].transpose(1, 2, 0)
    return out


def test_pixels_are_resized_padded_normalised_and_patchified():
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (900, 12000, 3), dtype=np.uint8))  # wide: shrunk to 512 columns
    patches, grid, original = process_image(image)
    plan = resize_plan(12000, 900)
    assert original == (12000, 900) and grid == plan.grid and patches.dtype == np.float32
    full = unpatchify(patches, grid)
    resized = np.asarray(image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(full[:plan.height, :plan.width], normalised(resized))
    assert np.all(full[plan.height:] == -1) and np.all(full[:, plan.width:] == -1)  # black padding -> -1


def test_transparency_is_composited_onto_the_chessboard_after_resize():
    clear = Image.new("RGBA", (20, 20), (10, 200, 30, 0))  # fully transparent
    full = unpatchify(*process_image(clear)[:2])
    assert np.all(full[:8, :8] == 1.0)  # white square at the top left
    np.testing.assert_allclose(full[:8, 8:16], normalised(np.full((8, 8, 3), 180)))
    opaque = Image.new("RGBA", (20, 20), (10, 200, 30, 255))
    np.testing.assert_array_equal(unpatchify(*process_image(opaque)[:2])[:20, :20], normalised(np.full((20, 20, 3),
                                                                                                        (10, 200, 30))))
    palette = Image.new("P", (20, 20), 0)
    palette.info["transparency"] = 0
    assert np.all(unpatchify(*process_image(palette)[:2])[:8, :8] == 1.0)
    gray = unpatchify(*process_image(Image.new("L", (20, 20), 100))[:2])
    np.testing.assert_allclose(gray[:20, :20], normalised(np.full((20, 20, 3), 100)))


def test_files_are_decoded_with_their_exif_orientation(tmp_path):
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (80, 30, 3), dtype=np.uint8))  # 30 x 80
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    image.save(tmp_path / "rotated.jpg", exif=exif)
    assert load_image(tmp_path / "rotated.jpg").size == (80, 30)
    pixels, grids = process_images([tmp_path / "rotated.jpg", image])
    assert grids.dtype == np.int64 and grids.tolist() == [[1, 4, 6], [1, 6, 4]]
    assert pixels.shape == (48, 3, 14, 14)


def test_prompt_text_and_ids():
    text = image_prompt_text(4000, 3000)
    assert text == "<|media_begin|>image 4000x3000<|media_content|><|media_pad|><|media_end|>"

    class Recorder:
        def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
            self.seen = (text, allow_special)
            return [1, 2]

    tokenizer = Recorder()
    assert image_prompt_ids(4000, 3000, tokenizer) == [1, 2] and tokenizer.seen == (text, True)


def test_processor_config_reads_the_release_file(tmp_path):
    assert ProcessorConfig.from_dir(tmp_path) == ProcessorConfig()
    release = {"media_proc_cfg": {
        "in_patch_limit": 65536, "patch_size": 14, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 16384, "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                  "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                  "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize",
    }}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(release))
    assert ProcessorConfig.from_dir(tmp_path) == ProcessorConfig()
    release["media_proc_cfg"]["in_patch_limit"] = 1024
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(release))
    assert resize_plan(4000, 3000, ProcessorConfig.from_dir(tmp_path)).num_tokens <= 1024 // 4 + 64
