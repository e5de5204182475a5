"""The architectures whose models read images, by name: what a front process (which imports
no model code) checks a chat request's images against. The model registry agrees with it (a
test checks)."""

IMAGE_ARCHITECTURES = frozenset(
    {
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    }
)


def accepts_images(architecture: str) -> bool:
    """Whether the architecture's model reads images (an unknown one reads none)."""
    return architecture in IMAGE_ARCHITECTURES
