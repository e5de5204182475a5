"""The architectures whose models read images, by name: what a front process (which imports
no model code) checks a chat request's images against. The model registry agrees with it (a
test checks)."""

IMAGE_ARCHITECTURES = frozenset(
    {
        "Gemma3ForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    }
)

# Those whose image tokens attend to their whole image (both ways): a prefill chunk never ends
# inside an image there, as its first tokens need its last ones' keys.
WHOLE_IMAGE_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


def accepts_images(architecture: str) -> bool:
    """Whether the architecture's model reads images (an unknown one reads none)."""
    return architecture in IMAGE_ARCHITECTURES


def images_attend_whole(architecture: str) -> bool:
    """Whether the architecture's image tokens attend to their whole image."""
    return architecture in WHOLE_IMAGE_ARCHITECTURES
