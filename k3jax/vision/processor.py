"""Image processing exact to the release's MoonViT processor (`preprocessor_config.json`, `media_proc_cfg`).

Per image of W x H pixels:
    s = min(1, sqrt(in_patch_limit / (max(1, W // 14) * max(1, H // 14))), 512 * 14 / W, 512 * 14 / H)
    W' = min(max(1, int(W * s)), 512 * 14), H' likewise       (never upscales; at most ~65K patches)
    resize to W' x H' with Pillow's bicubic filter, composite transparency onto a chessboard (after the
    resize, as the release config says), pad bottom/right with black to multiples of 28 (2x2 merge of
    14-pixel patches), scale to [0, 1], normalise with mean/std 0.5 (so padding becomes -1), and cut
    into 14 x 14 patches, row-major, channels first.
The prompt of each image names its ORIGINAL size: `<|media_begin|>image {W}x{H}<|media_content|>
<|media_pad|><|media_end|>`, the single `<|media_pad|>` standing for all of its (h/2)(w/2) tokens.

Pillow decodes files (EXIF orientation applied; grayscale, palette, CMYK converted to RGB). Video is
not supported: the released processor is image-only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

VIDEO_SUFFIXES = (".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v", ".mpeg", ".mpg", ".wmv", ".flv")
IMAGE_PROMPT = "<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"
ImageLike = Image.Image | str | Path


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """`media_proc_cfg`; the defaults are the release's values."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    chessboard_square_size: int = 8  # transparent_bg_config: 8-pixel squares, white at the top left
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 180
    fill_after_resize: bool = True  # transparent_bg_fill_stage == "after_resize"

    @classmethod
    def from_dir(cls, path: str | Path) -> "ProcessorConfig":
        """The `media_proc_cfg` of `path/preprocessor_config.json`, or the release defaults without one."""
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text()).get("media_proc_cfg", {})
        except (json.JSONDecodeError, AttributeError) as err:
            raise ValueError(f"{file} is not a JSON object with a media_proc_cfg: {err}") from None
        bg = raw.get("transparent_bg_config") or {}
        if bg and bg.get("pattern", "chessboard") != "chessboard":
            raise ValueError(f"{file}: transparent_bg_config.pattern={bg['pattern']!r} is not supported; expected "
                             "'chessboard'")
        if raw.get("fixed_output_tokens") is not None:
            raise ValueError(f"{file}: fixed_output_tokens={raw['fixed_output_tokens']!r} is not supported; expected null")
        default = cls()
        return cls(
            patch_size=int(raw.get("patch_size", default.patch_size)),
            merge_kernel_size=int(raw.get("merge_kernel_size", default.merge_kernel_size)),
            in_patch_limit=int(raw.get("in_patch_limit", default.in_patch_limit)),
            patch_limit_on_one_side=int(raw.get("patch_limit_on_one_side", default.patch_limit_on_one_side)),
            image_mean=tuple(raw.get("image_mean", default.image_mean)),
            image_std=tuple(raw.get("image_std", default.image_std)),
            chessboard_square_size=int(bg.get("chessboard_square_size", default.chessboard_square_size)),
            chessboard_white_value=int(bg.get("chessboard_white_value", default.chessboard_white_value)),
            chessboard_gray_value=int(bg.get("chessboard_gray_value", default.chessboard_gray_value)),
            fill_after_resize=raw.get("transparent_bg_fill_stage", "after_resize") == "after_resize",
        )


class ResizePlan(NamedTuple):
    width: int  # after the resize, before padding
    height: int
    pad_width: int
    pad_height: int
    grid: tuple[int, int, int]  # (1, rows, columns) in patches
    num_tokens: int  # text positions the image takes: (rows / 2) * (columns / 2)


def resize_plan(width: int, height: int, cfg: ProcessorConfig = ProcessorConfig()) -> ResizePlan:
    """The resize rule and pixel budget for a W x H image (no pixels needed)."""
    if isinstance(width, bool) or isinstance(height, bool) or not (isinstance(width, int) and isinstance(height, int)) \
            or width < 1 or height < 1:
        raise ValueError(f"image size {width!r} x {height!r}: expected positive integers")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0, math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    factor = cfg.merge_kernel_size * p
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    rows, cols = (new_h + pad_h) // p, (new_w + pad_w) // p
    return ResizePlan(new_w, new_h, pad_w, pad_h, (1, rows, cols),
                      (rows // cfg.merge_kernel_size) * (cols // cfg.merge_kernel_size))


def image_prompt_text(width: int, height: int) -> str:
    """The text standing for one image in a prompt; `width` x `height` is its ORIGINAL size."""
    return IMAGE_PROMPT.format(width=width, height=height)


def image_prompt_ids(width: int, height: int, tokenizer: Any) -> list[int]:
    """`image_prompt_text` as token ids (special tokens allowed) by a `k3jax.tokenizer` tokenizer."""
    return tokenizer.encode(image_prompt_text(width, height), allow_special=True)


def load_image(path: str | Path) -> Image.Image:
    """Decode an image file with Pillow, its EXIF orientation applied. Errors name the path."""
    path = Path(path)
    if path.suffix.lower() in VIDEO_SUFFIXES:
        raise ValueError(f"{path}: video is not supported (the released K3 processor takes images only)")
    if not path.is_file():
        raise FileNotFoundError(f"image file {path} does not exist")
    try:
        with Image.open(path) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"cannot decode image file {path}: {err}") from None
    return image  # an animated file: its first frame, as the release's processor takes it


def _chessboard(height: int, width: int, cfg: ProcessorConfig) -> np.ndarray:
    y = np.arange(height)[:, None] // cfg.chessboard_square_size
    x = np.arange(width)[None, :] // cfg.chessboard_square_size
    board = np.where((x + y) % 2 == 1, cfg.chessboard_gray_value, cfg.chessboard_white_value).astype(np.uint8)
    return np.repeat(board[:, :, None], 3, axis=2)


def to_rgb(image: Image.Image, cfg: ProcessorConfig = ProcessorConfig()) -> Image.Image:
    """RGB, with any transparency (alpha band, or a palette's transparent colour) composited onto the
    chessboard: alpha * rgb + (1 - alpha) * board in float32, truncated to uint8 as the release does."""
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    mixed = alpha * rgba[:, :, :3] + (1.0 - alpha) * _chessboard(rgba.shape[0], rgba.shape[1], cfg)
    return Image.fromarray(mixed.astype(np.uint8))


def _pixels(image: Image.Image, plan: ResizePlan, cfg: ProcessorConfig) -> np.ndarray:
    """Resized, composited, padded and normalised pixels [H' + pad, W' + pad, 3] float32."""
    if not cfg.fill_after_resize:
        image = to_rgb(image, cfg)
    image = to_rgb(image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC), cfg)
    array = np.pad(np.asarray(image), ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))
    x = array.astype(np.float32) / 255.0
    x -= np.asarray(cfg.image_mean)  # float64 operands, rounded into float32 in place, as the release does
    x *= 1.0 / np.asarray(cfg.image_std)
    return x


def process_image(image: ImageLike, cfg: ProcessorConfig = ProcessorConfig()) -> tuple[np.ndarray, tuple[int, int, int],
                                                                                        tuple[int, int]]:
    """One image (PIL image or file path) -> (patches [gh*gw, 3, p, p] float32, grid (1, gh, gw),
    original (width, height) for its prompt)."""
    if isinstance(image, (str, Path)):
        image = load_image(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image or an image file path, got {type(image).__name__}")
    width, height = image.size
    plan = resize_plan(width, height, cfg)
    x = _pixels(image, plan, cfg)
    p, (_, rows, cols) = cfg.patch_size, plan.grid
    patches = x.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)
    return np.ascontiguousarray(patches), plan.grid, (width, height)


def process_images(images: Sequence[ImageLike], cfg: ProcessorConfig = ProcessorConfig()) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """Images -> (pixel_values [sum gh*gw, 3, p, p] float32, grid_thws int64 [N, 3]), in order: what
    `model(input_ids, pixel_values=..., grid_thws=...)` takes with one placeholder per image."""
    if isinstance(images, (str, Path, Image.Image)) or not isinstance(images, Sequence) or not images:
        raise ValueError("process_images: expected a non-empty list of images (PIL images or file paths)")
    done = [process_image(image, cfg) for image in images]
    return np.concatenate([d[0] for d in done]), np.asarray([d[1] for d in done], np.int64)
