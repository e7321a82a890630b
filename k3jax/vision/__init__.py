"""Kimi K3's vision: the MoonViT-V2 tower, the patch-merger projector, and the merge of image features
into the text model (one placeholder token per image, expanded inside the model). Image files and
prompts: `k3jax.vision.processor` (Pillow; imported on its own so that the model needs no image
library). See docs/vision.md.

    from k3jax.vision.processor import image_prompt_text, process_images
    pixel_values, grid_thws = process_images(["photo.jpg"])
    logits = model(input_ids, pixel_values=pixel_values, grid_thws=grid_thws)
"""

from k3jax.vision.projector import Projector
from k3jax.vision.tower import VisionTower

__all__ = ["Projector", "VisionTower"]
