"""Qwen3-VL: the Qwen3 language model with interleaved M-RoPE, fed a vision tower's features.

The vision tower is transformers' own module, run eagerly: the step's new images go through it
once (their outputs wait in the runner's encoder cache), and each placeholder token's
embedding is replaced by its image's feature; the deepstack features are added to the hidden
states of the first layers' outputs at the same tokens. Attention stays causal.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PretrainedConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from heron.layers.rotary import MRotaryEmbedding
from heron.models.common import DecoderForCausalLM
from heron.models.llama import LlamaModel
from heron.multimodal.inputs import ImageItem, MultimodalStep
from heron.ops.selector import OperatorRuntime


class Qwen3VLForConditionalGeneration(DecoderForCausalLM):
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}
    is_multimodal = True

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        text_config = copy.copy(config.get_text_config())
        text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        model = LlamaModel(text_config, runtime, rotary_class=MRotaryEmbedding)
        super().__init__(text_config, model, runtime)
        vision_config = copy.copy(config.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.visual = Qwen3VLVisionModel(vision_config)
        self.merge_size = vision_config.spatial_merge_size
        self.image_token_id = config.image_token_id
        self.num_deepstack = len(vision_config.deepstack_visual_indexes)

    def encode(self, images: Sequence[ImageItem]) -> list[torch.Tensor]:
        """Each image's features ``[placeholders, 1 + deepstack, hidden]``, in one pass."""
        device = self.lm_head.weight.device
        dtype = self.visual.patch_embed.proj.weight.dtype
        pixels = torch.cat([item.pixel_values for item in images]).to(device, dtype)
        grid = torch.tensor([item.grid_thw for item in images], device=device)
        out = self.visual(pixels, grid_thw=grid, return_dict=True)
        features = torch.stack([out.pooler_output, *out.deepstack_features], dim=1)
        return list(features.split([item.length for item in images]))

    def mrope_positions(
        self, images: Sequence[ImageItem], num_prompt_tokens: int
    ) -> tuple[np.ndarray, int]:
        """The prompt's ``[3, tokens]`` positions, and the rope delta of what follows it
        (token ``i`` past the prompt is at ``i + delta`` on every axis): text advances by one a
        token, an image's tokens take their grid coordinates after the text before it, and the
        text after an image starts past its larger side."""
        parts, start, end = [], 0, 0
        for item in images:
            parts.append(np.arange(item.offset - end) + start)
            start += item.offset - end
            t, h, w = (
                item.grid_thw[0],
                item.grid_thw[1] // self.merge_size,
                item.grid_thw[2] // self.merge_size,
            )
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
            parts.append(grid.reshape(3, -1) + start)
            start += max(h, w)
            end = item.end
        parts.append(np.arange(num_prompt_tokens - end) + start)
        positions = np.concatenate([np.broadcast_to(p, (3, p.shape[-1])) for p in parts], axis=1)
        return positions, int(positions.max()) + 1 - num_prompt_tokens

    def forward(self, token_ids: torch.Tensor, mm: MultimodalStep | None = None) -> torch.Tensor:
        model = self.model
        model.rotary.step_positions = None if mm is None else mm.positions
        x, residual = model.embed(token_ids), None
        rows = None if mm is None else mm.rows
        if rows is not None:
            x[rows] = mm.features[:, 0].to(x.dtype)
        for i, layer in enumerate(model.layers):
            x, residual = layer(x, residual)
            if rows is not None and i < self.num_deepstack:
                # (the layer's output is x + residual: adding to x adds to it)
                x[rows] += mm.features[:, 1 + i].to(x.dtype)
        x, _ = model.norm(x, residual)
        return x
