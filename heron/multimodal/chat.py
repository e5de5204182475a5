"""OpenAI content parts of a conversation: its images taken out, the rest for the template."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from heron.multimodal.media import MediaPolicy

if TYPE_CHECKING:
    from PIL.Image import Image

    from heron.chat_template import Conversation

# Content part types that carry media Heron does not read.
_UNSUPPORTED_MEDIA = ("input_audio", "audio_url", "video_url", "video", "audio", "file")


def take_images(
    conversation: Conversation, policy: MediaPolicy
) -> tuple[Conversation, list[Image]]:
    """The conversation with each image part replaced by ``{"type": "image"}`` (what HF chat
    templates render as the model's image placeholder), and the images in order.

    An image part is ``image_url`` (``{"url": ...}``, loaded under ``policy``) or
    ``image_pil`` (a PIL image, offline); audio and video parts are refused by name."""
    images: list[Image] = []
    messages = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type")
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError("image_url: needs {'url': ...}")
                images.append(policy.load_image(url))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(part["image_pil"])
                parts.append({"type": "image"})
            elif kind in _UNSUPPORTED_MEDIA:
                raise ValueError(f"content parts of type {kind!r} are not supported (images only)")
            else:
                parts.append(part)
        messages.append({**message, "content": parts})
    return messages, images
