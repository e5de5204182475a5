"""Building a model inside the platform's build scope and resolving its metadata plan."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from heron.config import ModelConfig
from heron.loader.safetensors import iterate_weights
from heron.loader.weights import load_weights
from heron.metadata import MetadataBuilder, MetadataOperator, StepMetaPlan
from heron.models.registry import model_class
from heron.ops.attention.paged import PagedAttentionBuilder
from heron.ops.selector import OperatorRuntime, layer_kernels
from heron.platforms import Platform

logger = logging.getLogger(__name__)


class PlanHolder(Protocol):
    plan: StepMetaPlan | None


def compatibility_builder(model_config: ModelConfig, block_size: int) -> MetadataBuilder:
    """Metadata derived from the model configuration, as engines before Heron did.

    One sliding window for the whole model, if the config names one: exactly the guess that
    goes wrong for models that mix layer kinds, which is why it is only the fallback.
    """
    window = getattr(model_config.hf_config, "sliding_window", None)
    return PagedAttentionBuilder("fallback", block_size, window, model_config.max_model_len)


def build_model(
    model_config: ModelConfig,
    platform: Platform,
    target: PlanHolder,
    attention_backend: str,
    block_size: int,
) -> nn.Module:
    """Build, load and plan the model; attach the plan to ``target`` only if all succeeded."""
    target.plan = None
    cls = model_class(model_config.architecture)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with platform.model_build_context() as scope, torch.device(platform.device):
            runtime = OperatorRuntime(
                attention_backend,
                block_size,
                model_config.max_model_len,
                scope,
                layer_kernels(platform.layer_kernels()),
            )
            model = cls(model_config.hf_config, runtime)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.to(platform.device)
    load_weights(model, iterate_weights(model_config.path))
    model.eval()

    fallback = lambda: compatibility_builder(model_config, block_size)
    if scope.collecting:
        plan = StepMetaPlan.from_operators(scope.operators, fallback)
    else:
        operators = [m for m in model.modules() if isinstance(m, MetadataOperator)]
        plan = StepMetaPlan.from_operators(
            operators,
            fallback,
            fallback_reason=f"platform {platform.name!r} does not collect operator metadata",
        )
    plan.check_coverage(model)
    if plan.fallback_reason:
        logger.warning("metadata plan uses the compatibility fallback: %s", plan.fallback_reason)
    target.plan = plan
    return model
