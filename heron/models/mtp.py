"""Multi-token prediction (MTP) heads: the extra decoder layer(s) some checkpoints ship after
the last one, which predict the token after next from the target model's hidden state.

One MTP step at position ``i`` combines the embedding of token ``t_{i+1}`` with the target's
hidden state at ``i`` (after the target's final norm, as vLLM, SGLang and HF pass it): each is
RMS-normed, the two are concatenated (embedding first) and projected back to the hidden size,
run through a full decoder layer of the family (its attention with its own cache) and normed;
the target's LM head turns that into the logits of ``t_{i+2}``. A further step feeds the normed
output back as the hidden state (as HF's ``MtpModel`` chains its layers), through layer ``step
% num_layers``.

The family's subclass builds the layers under the checkpoint's names and says which tensors
are its own (``checkpoint_prefixes``); the embedding and LM head are the target's (DeepSeek's
stored copies of them are not loaded, as SGLang and HF share the target's).
"""

from __future__ import annotations

import torch
from torch import nn

from heron.models.common import DecoderForCausalLM


class MultiTokenPredictor(nn.Module):
    """A family's MTP layers over the ``target``'s embedding and LM head.

    The target's modules are held outside the module tree (they are the target's weights: not
    loaded, counted or moved again here). A subclass registers its modules under the
    checkpoint's names, then lists each MTP layer's ``(embedding norm, hidden norm, projection,
    decoder layer, output norm)`` in ``layers``.
    """

    # load_weights: tensors outside ``checkpoint_prefixes`` are the target's, skipped.
    loads_prefixes_only = True

    def __init__(self, target: DecoderForCausalLM) -> None:
        super().__init__()
        self._target = (target,)
        self.layers_parts: list[tuple[nn.Module, nn.Module, nn.Module, nn.Module, nn.Module]] = []

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """The normed hidden state after ``token_ids``; ``hidden`` holds, row by row, the
        target's (or the previous step's) hidden state one position earlier."""
        embed_norm, hidden_norm, projection, layer, output_norm = self.layers_parts[
            step % len(self.layers_parts)
        ]
        embeds = self._target[0].model.embed(token_ids)
        x = projection(torch.cat([embed_norm(embeds), hidden_norm(hidden)], dim=-1))
        x, residual = layer(x, None)
        return output_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)


def num_mtp_layers(config, field: str) -> int:
    """The config's count of MTP layers (``field``); a clear error when it names none."""
    count = getattr(config, field, None) or 0
    if count < 1:
        raise ValueError(
            f"speculative method 'mtp' needs multi-token-prediction layers, but this model's "
            f"config has {field} = {getattr(config, field, None)!r}"
        )
    return count
