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
    checkpoint), or a yes/no reranker's two LM-head rows (``lm_head``, or the embedding's
    where they are tied), whose difference scores."""

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
        self.lm_head: TokenRows | None = None
        if pooling.classifier_token_ids:
            tied = bool(getattr(config, "tie_word_embeddings", False))
            self.lm_head = TokenRows(pooling.classifier_token_ids, hidden, tied)
            if not tied:  # (an instance's prefixes: these read the LM head)
                self.checkpoint_prefixes = {
                    k: v for k, v in self.checkpoint_prefixes.items() if k != "lm_head."
                }
        elif pooling.reward_head:
            self.score = nn.Sequential(
                Linear(hidden, hidden, True, kernels),
                nn.ReLU(),
                Linear(hidden, num_labels, True, kernels),
            )
        elif num_labels is not None:
            self.score = Linear(hidden, num_labels, False, kernels)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model(token_ids)

    def finish_loading(self) -> None:
        if self.lm_head is not None and self.lm_head.tied:
            with torch.no_grad():
                rows = self.model.embed_tokens.weight[list(self.lm_head.token_ids)]
                self.lm_head.weight.copy_(rows)

    def compute_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head's output for pooled hidden states: a classifier's logits, an embedding
        model's hidden states as they are."""
        if self.lm_head is not None:
            false, true = (pooled.float() @ self.lm_head.weight.float().T).unbind(-1)
            return (true - false).unsqueeze(-1).to(pooled.dtype)
        return pooled if self.score is None else self.score(pooled)


class TokenRows(nn.Module):
    """An LM head's rows of a few tokens: loaded from the checkpoint's ``lm_head.weight``
    (the other rows are never held), or, ``tied`` to the embedding, copied from it once
    loaded (then a buffer: the checkpoint has no such tensor)."""

    def __init__(self, token_ids: tuple[int, ...], hidden_size: int, tied: bool) -> None:
        super().__init__()
        self.token_ids, self.tied = token_ids, tied
        rows = torch.empty(len(token_ids), hidden_size)
        if tied:
            self.register_buffer("weight", rows)
        else:
            self.weight = nn.Parameter(rows, requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: None) -> None:
        param.copy_(loaded[list(self.token_ids)])
