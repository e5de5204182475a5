"""A chat request's images: counted, fetched under the server's media policy and processed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig

from heron.multimodal.architectures import accepts_images
from heron.multimodal.chat import take_images
from heron.multimodal.media import MediaPolicy
from heron.multimodal.processor import ImageProcessor

if TYPE_CHECKING:
    from PIL.Image import Image

    from heron.chat_template import Conversation
    from heron.multimodal.inputs import ImageItem


class ServerImages:
    """What the front does with ``image_url`` parts before the engine sees the request:
    refuse them for a text-only model or past ``limit`` a prompt, before anything is fetched;
    load them under ``policy``; expand the prompt's placeholders (the model's image
    processor, loaded on first use)."""

    def __init__(self, model_path: str, policy: MediaPolicy, limit: int | None) -> None:
        self.model_path = Path(model_path)
        self.policy = policy
        self.limit = limit
        self._hf_config = AutoConfig.from_pretrained(self.model_path)
        self.architecture = (self._hf_config.architectures or ["?"])[0]
        self._processor: ImageProcessor | None = None

    def take(self, conversation: Conversation) -> tuple[Conversation, list[Image]]:
        count = sum(
            part.get("type") == "image_url"
            for m in conversation
            if isinstance(m.get("content"), list)
            for part in m["content"]
        )
        if not accepts_images(self.architecture):
            raise ValueError(f"{self.architecture} is a text-only model: it takes no images")
        if self.limit is not None and count > self.limit:
            raise ValueError(
                f"the prompt has {count} images, more than --limit-mm-per-prompt allows "
                f"({self.limit})"
            )
        return take_images(conversation, self.policy)

    def process(
        self, token_ids: list[int], images: list[Image]
    ) -> tuple[list[int], tuple[ImageItem, ...]]:
        if self._processor is None:
            self._processor = ImageProcessor(self.model_path, self._hf_config)
        return self._processor.process(token_ids, images)
