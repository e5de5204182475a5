"""Images in for a decoder: a vision tower's features in place of the image placeholders.

Qwen3-VL and Qwen3.5 share the scheme: transformers' own vision tower, run eagerly on the
images a step newly reaches (their outputs wait in the runner's encoder cache); each
placeholder token's embedding is replaced by its image's feature, and deepstack features (where
the tower has them) are added to the first layers' outputs at the same tokens; positions are
interleaved M-RoPE (:class:`MRotaryEmbedding`). Attention stays causal.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from heron.multimodal.inputs import ImageItem, MultimodalStep


def language_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text config of a multimodal checkpoint, its head tied as the top-level config says
    (as HF ties it)."""
    text_config = copy.copy(config.get_text_config())
    text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text_config


class ImagesIn:
    """Mixed into a ``DecoderForCausalLM`` whose ``model.rotary`` is an
    :class:`MRotaryEmbedding` and whose layers leave no ``output_norm``; call
    :meth:`attach_vision` after its constructor."""

    is_multimodal = True
    model: nn.Module
    lm_head: nn.Module

    def attach_vision(self, config: PretrainedConfig, tower: type[nn.Module]) -> None:
        vision_config = copy.copy(config.vision_config)
        vision_config._attn_implementation = "sdpa"
        self.visual = tower(vision_config)
        self.merge_size = vision_config.spatial_merge_size
        self.num_deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())

    def encode(self, images: Sequence[ImageItem]) -> list[torch.Tensor]:
        """Each image's features ``[placeholders, 1 + deepstack, hidden]``, in one pass."""
        device = self.lm_head.weight.device
        dtype = self.visual.patch_embed.proj.weight.dtype
        pixels = torch.cat([item.pixel_values for item in images]).to(device, dtype)
        grid = torch.tensor([item.grid_thw for item in images], device=device)
        out = self.visual(pixels, grid_thw=grid, return_dict=True)
        deepstack = getattr(out, "deepstack_features", None) or []
        features = torch.stack([out.pooler_output, *deepstack], dim=1)
        return list(features.split([item.length for item in images]))

    def mrope_positions(
        self, images: Sequence[ImageItem], num_prompt_tokens: int
    ) -> tuple[np.ndarray, int]:
        """The prompt's ``[3, tokens]`` positions, and the rope delta of what follows it
        (token ``i`` past the prompt is at ``i + delta`` on every axis): text advances by one a
        token, an image's tokens take their grid coordinates after the text before it, and the
        text after an image starts past its larger side."""
        parts, start, end = [], 0, 0
        m = self.merge_size
        for item in images:
            parts.append(np.arange(item.offset - end) + start)
            start += item.offset - end
            t, h, w = item.grid_thw[0], item.grid_thw[1] // m, item.grid_thw[2] // m
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
