"""Prompt images to the engine's inputs through the model's own HF image processor.

transformers' default (fast) image processors need torchvision; its PIL implementation of the
same processor (``<Name>ImageProcessorPil``) computes the same pixels without it, so that is
the one loaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from transformers import PretrainedConfig

from heron.multimodal.inputs import ImageItem, image_hash

if TYPE_CHECKING:
    from PIL.Image import Image


class ImageProcessor:
    """Checks a prompt's images, turns them into pixel patches, and expands each image's one
    placeholder token into as many as its encoder output has rows."""

    def __init__(self, model_path: Path, hf_config: PretrainedConfig) -> None:
        config_file = Path(model_path) / "preprocessor_config.json"
        if not config_file.is_file():
            raise ValueError(f"{model_path} has no preprocessor_config.json (image processor)")
        name = json.loads(config_file.read_text())["image_processor_type"].removesuffix("Fast")
        cls = getattr(transformers, f"{name}Pil", None)
        if cls is None:
            raise ValueError(f"image processor {name}: transformers has no PIL implementation")
        self.hf = cls.from_pretrained(model_path)
        self.image_token_id = hf_config.image_token_id
        self.merge_size = self.hf.merge_size
        self.max_pixels = self.hf.size["longest_edge"]

    def process(
        self, token_ids: Sequence[int], images: Sequence[Image]
    ) -> tuple[list[int], tuple[ImageItem, ...]]:
        """The prompt with its placeholders expanded, and its images (``ValueError`` naming a
        placeholder count that does not match, or an image too large)."""
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholders but {len(images)} images"
            )
        if not images:
            return list(token_ids), ()
        for i, image in enumerate(images):
            if image.width * image.height > self.max_pixels:
                raise ValueError(
                    f"image {i} has {image.width}x{image.height} pixels, more than the image "
                    f"processor's maximum of {self.max_pixels}"
                )
        rgb = [image.convert("RGB") for image in images]
        out = self.hf(images=rgb, return_tensors="pt")
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        pixels = torch.split(out["pixel_values"], [t * h * w for t, h, w in grids])
        expanded: list[int] = []
        items = []
        previous = 0
        for slot, image, grid, values in zip(slots, rgb, grids, pixels):
            expanded += token_ids[previous:slot]
            length = grid[0] * grid[1] * grid[2] // self.merge_size**2
            digest = image_hash(image.mode, image.size, image.tobytes())
            items.append(ImageItem(digest, values, grid, len(expanded), length))
            expanded += [self.image_token_id] * length
            previous = slot + 1
        expanded += token_ids[previous:]
        return expanded, tuple(items)
