"""Random weights from the config alone (``load_format="dummy"``), for benchmarking shapes."""

from __future__ import annotations

import torch
from torch import nn

from heron.layers.norm import RMSNorm


def initialize_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Fill every parameter in place, on its device and in its dtype, from one seeded stream.

    Matrices (projections, embeddings, routers, experts) are normal(0, ``std``), as a fresh HF
    model's; norm scales are neutral (1, or 0 for the ``(1 + w)`` form) so activations keep
    their scale through the layers (a vision tower's layer norms too); other vectors (biases,
    attention sinks) are zero. Packed integer parameters (MXFP4 experts) are left to their
    module.
    """
    norm_fill = {
        id(m.weight): 1.0 - m.weight_offset for m in model.modules() if isinstance(m, RMSNorm)
    }
    norm_fill |= {id(m.weight): 1.0 for m in model.modules() if isinstance(m, nn.LayerNorm)}
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            if id(param) in norm_fill:
                param.fill_(norm_fill[id(param)])
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
