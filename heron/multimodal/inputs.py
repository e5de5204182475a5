"""A request's images as the engine carries them: pixels, grid and placeholder range."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt: the processor's pixel patches and grid (``t, h, w`` in
    patches), and the prompt tokens ``offset .. offset + length`` its encoder output fills.

    ``content_hash`` keys the encoder cache and enters the prefix cache's block hashes, so two
    prompts with the same text but different images never share either."""

    content_hash: str
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


def image_hash(mode: str, size: tuple[int, int], data: bytes) -> str:
    """A digest of an image's decoded pixels (not its file bytes: the same picture sent as
    PNG and as a data URL is one image)."""
    digest = hashlib.sha256(f"{mode}:{size[0]}x{size[1]}:".encode())
    digest.update(data)
    return digest.hexdigest()


def block_hash_extras(items: Sequence[ImageItem], start: int, end: int) -> tuple[str, ...]:
    """The content hashes of the images whose placeholders fall in tokens ``start .. end``."""
    return tuple(item.content_hash for item in items if item.overlaps(start, end))


@dataclass(frozen=True)
class MultimodalStep:
    """What a multimodal model reads in one step beside the token ids: each token's M-RoPE
    positions (``[3, tokens]``; None: the view's, for a model without M-RoPE), the encoder
    features (``[rows, 1 + deepstack, hidden]``: the embedding, then what each early layer
    adds) of the step's placeholder tokens ``rows``, and, for a model whose image tokens
    attend to their whole image, each token's key limit (``SequenceMetadata.key_limits``)."""

    positions: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    features: torch.Tensor | None = None
    key_limits: torch.Tensor | None = None
