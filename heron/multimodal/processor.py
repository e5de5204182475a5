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
from transformers import AutoTokenizer, PretrainedConfig

from heron.multimodal.inputs import ImageItem, image_hash

if TYPE_CHECKING:
    from PIL.Image import Image

Grid = tuple[int, int, int]


class _Placeholders:
    """How a model's image placeholder expands: ``before``, the image tokens, ``after``."""

    before: list[int] = []
    after: list[int] = []
    newline_runs: dict[int, int] = {}  # run length -> token (those the seams may merge)

    def join(self, ids: list[int], tokens: Sequence[int]) -> None:
        """``ids += tokens``, a newline run at their seam merged into one token where the
        vocabulary has it."""
        runs = {t: n for n, t in self.newline_runs.items()}
        if ids and tokens and ids[-1] in runs and tokens[0] in runs:
            merged = self.newline_runs.get(runs[ids[-1]] + runs[tokens[0]])
            if merged is not None:
                ids[-1] = merged
                tokens = tokens[1:]
        ids += tokens


class _QwenPlaceholders(_Placeholders):
    """Qwen-VL's: each ``image_token_id`` becomes one per merged patch of its image."""

    def __init__(self, hf, hf_config: PretrainedConfig, model_path: Path) -> None:
        self.placeholder = self.image_token_id = hf_config.image_token_id
        self.merge_size = hf.merge_size
        self.max_pixels = hf.size["longest_edge"]

    def split(self, out) -> list[tuple[torch.Tensor, Grid]]:
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        pixels = torch.split(out["pixel_values"], [t * h * w for t, h, w in grids])
        return list(zip(pixels, grids))

    def length(self, grid: Grid) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge_size**2


class _Gemma3Placeholders(_Placeholders):
    """Gemma 3's: the chat template's ``<start_of_image>`` becomes the sequence HF's
    ``Gemma3Processor`` writes, ``\\n\\n<start_of_image>``, ``mm_tokens_per_image`` image
    tokens, ``<end_of_image>\\n\\n``; every image is resized to one size (no maximum)."""

    max_pixels = None

    def __init__(self, hf, hf_config: PretrainedConfig, model_path: Path) -> None:
        if getattr(hf, "do_pan_and_scan", False):
            raise ValueError("image processor: do_pan_and_scan is not supported")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        self.placeholder = hf_config.boi_token_index
        self.image_token_id = hf_config.image_token_index
        self.before = [*newlines, hf_config.boi_token_index]
        self.after = [hf_config.eoi_token_index, *newlines]
        self.tokens = hf_config.mm_tokens_per_image
        self.patch_size = hf_config.vision_config.patch_size
        # The vocabulary's newline runs, by length: HF tokenizes the expanded text, where the
        # inserted newlines and the prompt's next to them make one run (one token).
        self.newline_runs = {}
        for n in range(1, 33):
            ids = tokenizer.encode("\n" * n, add_special_tokens=False)
            if len(ids) == 1:
                self.newline_runs[n] = ids[0]

    def split(self, out) -> list[tuple[torch.Tensor, Grid]]:
        _, _, h, w = out["pixel_values"].shape
        grid = (1, h // self.patch_size, w // self.patch_size)
        return [(values[None], grid) for values in out["pixel_values"]]

    def length(self, grid: Grid) -> int:
        return self.tokens


class ImageProcessor:
    """Checks a prompt's images, turns them into pixels, and expands each image's one
    placeholder token into the model's image sequence, with as many image tokens as its
    encoder output has rows."""

    def __init__(self, model_path: Path, hf_config: PretrainedConfig) -> None:
        config_file = Path(model_path) / "preprocessor_config.json"
        if not config_file.is_file():
            raise ValueError(f"{model_path} has no preprocessor_config.json (image processor)")
        name = json.loads(config_file.read_text())["image_processor_type"].removesuffix("Fast")
        cls = getattr(transformers, f"{name}Pil", None)
        if cls is None:
            raise ValueError(f"image processor {name}: transformers has no PIL implementation")
        self.hf = cls.from_pretrained(model_path)
        gemma3 = hf_config.model_type == "gemma3"
        scheme = _Gemma3Placeholders if gemma3 else _QwenPlaceholders
        self.placeholders = scheme(self.hf, hf_config, Path(model_path))

    def process(
        self, token_ids: Sequence[int], images: Sequence[Image]
    ) -> tuple[list[int], tuple[ImageItem, ...]]:
        """The prompt with its placeholders expanded, and its images (``ValueError`` naming a
        placeholder count that does not match, or an image too large)."""
        scheme = self.placeholders
        slots = [i for i, t in enumerate(token_ids) if t == scheme.placeholder]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholders but {len(images)} images"
            )
        if not images:
            return list(token_ids), ()
        for i, image in enumerate(images):
            if scheme.max_pixels is not None and image.width * image.height > scheme.max_pixels:
                raise ValueError(
                    f"image {i} has {image.width}x{image.height} pixels, more than the image "
                    f"processor's maximum of {scheme.max_pixels}"
                )
        rgb = [image.convert("RGB") for image in images]
        pixels = scheme.split(self.hf(images=rgb, return_tensors="pt"))
        expanded: list[int] = []
        items = []
        previous = 0
        for slot, image, (values, grid) in zip(slots, rgb, pixels):
            scheme.join(expanded, token_ids[previous:slot])
            scheme.join(expanded, scheme.before)
            length = scheme.length(grid)
            digest = image_hash(image.mode, image.size, image.tobytes())
            items.append(ImageItem(digest, values, grid, len(expanded), length))
            expanded += [scheme.image_token_id] * length
            expanded += scheme.after
            previous = slot + 1
        scheme.join(expanded, token_ids[previous:])
        return expanded, tuple(items)
