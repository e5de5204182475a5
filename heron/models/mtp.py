"""Multi-token prediction (MTP) heads: the extra decoder layer(s) some checkpoints ship after
the last one, which predict the token after next from the target model's hidden state.

The head at position ``i`` combines the embedding of token ``t_{i+1}`` with the target's hidden
state at ``i`` (after the target's final norm, as vLLM, SGLang and HF pass it): each is
RMS-normed, the two are concatenated (embedding first) and projected back to the hidden size,
run through a full decoder layer of the family (its attention with its own cache) and normed;
the target's LM head turns that into the logits of ``t_{i+2}``. A further proposal feeds the
normed output back as the hidden state (as HF's ``MtpModel`` chains its layers) through the
same layer, as vLLM does with one layer: only the first MTP layer is built, its stored
successors are skipped.

The family's subclass builds the layer under the checkpoint's names and says which tensors are
its own (``checkpoint_prefixes``); the embedding and LM head are the target's (DeepSeek's stored
copies of them are not loaded, as SGLang and HF share the target's).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from heron.models.common import DecoderForCausalLM


class MultiTokenPredictor(nn.Module):
    """A family's first MTP layer over the ``target``'s embedding and LM head.

    It runs as any model does (``forward(token_ids)``, ``compute_logits``), so a plain
    :class:`~heron.execution.model_runner.ModelRunner` (eager or from its CUDA graphs) steps it:
    the hidden states that go with the step's tokens are staged first (:meth:`stage_hidden`)
    into a buffer of fixed address (:meth:`reserve_hidden_rows`), which graphs read.
    The target's modules are held outside the module tree (they are the target's weights: not
    loaded, counted or moved again here). A subclass registers its modules under the
    checkpoint's names, then sets ``parts``: ``(embedding norm, hidden norm, projection,
    decoder layer, output norm)``.
    """

    # load_weights: tensors outside ``checkpoint_prefixes`` are the target's, skipped.
    loads_prefixes_only = True
    parts: tuple[nn.Module, nn.Module, nn.Module, nn.Module, nn.Module]

    def __init__(self, target: DecoderForCausalLM) -> None:
        super().__init__()
        self._target = (target,)
        self._hidden = torch.zeros(0, target.config.hidden_size)

    def reserve_hidden_rows(self, num_rows: int) -> None:
        """Room for ``num_rows`` staged rows (before graphs are captured: they read it)."""
        if num_rows > len(self._hidden):
            weight = self.parts[0].weight  # (a norm's: in the model's dtype)
            self._hidden = torch.zeros(
                num_rows, self._hidden.shape[1], dtype=weight.dtype, device=weight.device
            )

    def zero_hidden(self, num_rows: int) -> torch.Tensor:
        """Hidden rows of zeros (positions whose target state is unknown)."""
        return self._hidden.new_zeros(num_rows, self._hidden.shape[1])

    def stage_hidden(self, hidden: torch.Tensor) -> None:
        """The next step's input hidden states, row by row: the target's (or this head's own
        last output) one position before each token."""
        if len(hidden) > len(self._hidden):
            raise ValueError(
                f"{len(hidden)} hidden rows staged, room for {len(self._hidden)} reserved"
            )
        self._hidden[: len(hidden)].copy_(hidden)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The normed hidden state after each token, from the staged hidden states."""
        embed_norm, hidden_norm, projection, layer, output_norm = self.parts
        embeds = self._target[0].model.embed(token_ids)
        hidden = self._hidden[: len(token_ids)]
        x = projection(torch.cat([embed_norm(embeds), hidden_norm(hidden)], dim=-1))
        x, residual = layer(x, None)
        return output_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)


def num_mtp_layers(config: PretrainedConfig, field: str) -> int:
    """The config's count of MTP layers (``field``); a clear error when it names none."""
    count = getattr(config, field, None) or 0
    if count < 1:
        raise ValueError(
            f"the model's config names no multi-token-prediction layers ({field} = "
            f"{getattr(config, field, None)!r})"
        )
    return count
