"""Pooling models: a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) whose hidden states
the runner's pooler reduces to one vector per input, under a classification head, a reward
head or none (which checkpoints pool, and how: :mod:`heron.pooler_config`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.layers.linear import Linear
from heron.models.common import PACKED_MODULES
from heron.models.llama import LlamaModel
from heron.ops.selector import OperatorRuntime
from heron.pooler_config import PoolerConfig


class DecoderForPooling(nn.Module):
    """A Llama-family decoder and, for a classifier, its ``score`` head: one linear layer, or a
    reward model's ``Linear, ReLU, Linear`` (with biases; ``score.0`` and ``score.2`` in its
    checkpoint)."""

    packed_modules = PACKED_MODULES
    # A causal LM's head is not used; a bare decoder's tensors lack the ``model.`` prefix.
    checkpoint_prefixes = {
        "lm_head.": None,
        "layers.": "model.layers.",
        "embed_tokens.": "model.embed_tokens.",
        "norm.": "model.norm.",
    }

    def __init__(
        self, config: PretrainedConfig, runtime: OperatorRuntime, pooling: PoolerConfig
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, runtime)
        hidden, num_labels, kernels = config.hidden_size, pooling.num_labels, runtime.kernels
        self.score: nn.Module | None = None
        if pooling.reward_head:
            self.score = nn.Sequential(
                Linear(hidden, hidden, True, kernels),
                nn.ReLU(),
                Linear(hidden, num_labels, True, kernels),
            )
        elif num_labels is not None:
            self.score = Linear(hidden, num_labels, False, kernels)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model(token_ids)

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's output for pooled hidden states: a classifier's logits, an embedding
        model's hidden states as they are."""
        return pooled if self.score is None else self.score(pooled)
