"""Kimi K3's vision: the MoonViT-V2 tower, the patch-merger projector, image processing, and the
merge of image features into the text model (one placeholder token per image, expanded inside the
model). See docs/vision.md.

    pixel_values, grid_thws = process_images(["photo.jpg"])
    prompt = "Describe " + image_prompt_text(width, height)      # tokenised with special tokens allowed
    logits = model(input_ids, pixel_values=pixel_values, grid_thws=grid_thws)
"""

from k3jax.vision.processor import (
    ProcessorConfig, ResizePlan, image_prompt_ids, image_prompt_text, load_image, process_image, process_images,
    resize_plan,
)
from k3jax.vision.projector import Projector
from k3jax.vision.tower import VisionTower

__all__ = [
    "ProcessorConfig", "Projector", "ResizePlan", "VisionTower", "image_prompt_ids", "image_prompt_text",
    "load_image", "process_image", "process_images", "resize_plan",
]
