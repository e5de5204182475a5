"""Gemma 3 with images: the Gemma 3 language model fed transformers' SigLIP vision tower and
Gemma 3 projector at the image placeholders.

Each image becomes ``mm_tokens_per_image`` features (the tower's patches, average-pooled,
normed and projected); they replace the placeholder tokens' embeddings, which (unlike the
text's) are not scaled by ``sqrt(hidden_size)``, as in HF's ``Gemma3Model``. An image's tokens
attend to every token of that image, both ways (``images_attend_whole``: the runner gives the
attention per-token key limits and the scheduler never ends a chunk inside an image); text
stays causal, and sliding-window layers keep their window on top. Positions are plain.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import AutoModel, PretrainedConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from heron.models.gemma import GemmaForCausalLM
from heron.models.vision_language import language_config
from heron.multimodal.inputs import ImageItem, MultimodalStep
from heron.ops.selector import OperatorRuntime


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    is_multimodal = True
    images_attend_whole = True
    # transformers writes Gemma 3 as its first checkpoints are (language_model.model., ...);
    # its own module names (model.language_model., ...) are read too.
    checkpoint_prefixes = {
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.vision_model.": "vision_tower.",
        "model.language_model.": "model.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
    }

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(language_config(config), runtime)
        vision_config = copy.copy(config.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.vision_tower = AutoModel.from_config(vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def encode(self, images: Sequence[ImageItem]) -> list[torch.Tensor]:
        """Each image's features ``[mm_tokens_per_image, 1, hidden]``, in one pass."""
        device = self.lm_head.weight.device
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = torch.cat([item.pixel_values for item in images]).to(device, dtype)
        hidden = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return list(self.multi_modal_projector(hidden)[:, :, None])

    def forward(self, token_ids: torch.Tensor, mm: MultimodalStep | None = None) -> torch.Tensor:
        x = self.model.embed(token_ids)
        if mm is not None and mm.rows is not None:
            x[mm.rows] = mm.features[:, 0].to(x.dtype)
        return self.model.forward_embeddings(x)
