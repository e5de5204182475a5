"""Filling a built model's parameters: from checkpoint files, or random (``dummy``)."""

from __future__ import annotations

from torch import nn

from heron.config import ModelConfig
from heron.loader.dummy import initialize_dummy_weights
from heron.loader.safetensors import iterate_weights
from heron.loader.weights import load_weights


def load_model(model: nn.Module, model_config: ModelConfig) -> None:
    if model_config.load_format == "dummy":
        std = getattr(model_config.hf_config, "initializer_range", None) or 0.02
        initialize_dummy_weights(model, std, model_config.seed)
    else:
        load_weights(model, iterate_weights(model_config.path))
