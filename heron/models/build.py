"""Building a model inside the platform's build scope and resolving its metadata plan."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from heron.config import ModelConfig
from heron.loader import load_model
from heron.lora.attach import attach_lora
from heron.lora.config import LoRAConfig
from heron.metadata import MetadataBuilder, MetadataOperator, StepMetadataError, StepMetaPlan
from heron.models.pooling import DecoderForPooling
from heron.models.registry import model_class, mtp_class
from heron.ops.attention.base import AttentionOperator
from heron.ops.attention.paged import PagedAttentionBuilder
from heron.ops.selector import OperatorRuntime, layer_kernels
from heron.parallel import SINGLE, TensorParallel, tensor_parallel_scope
from heron.platforms import Platform
from heron.pooler_config import PoolerConfig

logger = logging.getLogger(__name__)


class BuiltModel(NamedTuple):
    """A built, loaded model and the metadata plan of its operators."""

    model: nn.Module
    plan: StepMetaPlan


def compatibility_builder(
    model_config: ModelConfig, block_size: int, operators: Sequence[MetadataOperator]
) -> MetadataBuilder:
    """Metadata derived from the model configuration, as engines before Heron did, for the
    ``operators`` that fall back to it.

    One sliding window for the whole model, if the config names one: exactly the guess that
    goes wrong for models that mix layer kinds, so an operator it would serve wrongly (another
    window, or not paged attention) is refused with the reason.
    """
    window = getattr(model_config.hf_config, "sliding_window", None)
    for op in operators:
        if not isinstance(op, AttentionOperator):
            raise StepMetadataError(
                f"layer {op.layer_name!r}: the compatibility fallback only serves paged "
                f"attention, not {type(op).__name__}"
            )
        if op.spec.sliding_window != window:
            raise StepMetadataError(
                f"layer {op.layer_name!r} attends over sliding window {op.spec.sliding_window}, "
                f"but the compatibility fallback gives every layer the model config's window "
                f"({window}); this model needs a platform that collects operator metadata"
            )
    return PagedAttentionBuilder("fallback", block_size, window, model_config.max_model_len)


def build_model(
    model_config: ModelConfig,
    platform: Platform,
    attention_backend: str,
    block_size: int,
    tp: TensorParallel = SINGLE,
    lora: LoRAConfig | None = None,
) -> BuiltModel:
    """Build, load and plan the model (this rank's shard of it, under ``tp``); with ``lora``
    its targeted linear layers get LoRA operators, registered in the same scope."""
    cls = model_class(model_config.architecture)

    def construct(runtime: OperatorRuntime) -> nn.Module:
        model = cls(model_config.hf_config, runtime)
        if lora is not None:
            attach_lora(model, lora)
        return model

    return _build(construct, model_config, platform, attention_backend, block_size, tp)


def build_pooling_model(
    model_config: ModelConfig,
    platform: Platform,
    attention_backend: str,
    block_size: int,
    tp: TensorParallel = SINGLE,
    lora: LoRAConfig | None = None,
    *,
    pooling: PoolerConfig,
) -> BuiltModel:
    """Build, load and plan a pooling model (``heron.models.pooling``): its decoder, and the
    head ``pooling`` says (none for an embedding model). It runs no LoRA adapter."""
    if lora is not None:
        raise ValueError("enable_lora is not supported with the pooling runner")
    construct = lambda runtime: DecoderForPooling(model_config.hf_config, runtime, pooling)
    return _build(construct, model_config, platform, attention_backend, block_size, tp)


def build_mtp(
    model: nn.Module,
    model_config: ModelConfig,
    platform: Platform,
    attention_backend: str,
    block_size: int,
) -> BuiltModel:
    """The multi-token-prediction head of the built target ``model``, loaded from the target's
    checkpoint, in a build scope of its own: its operators form their own plan and cache
    groups."""
    cls = mtp_class(model_config.architecture)
    construct = lambda runtime: cls(model, runtime)
    try:
        return _build(construct, model_config, platform, attention_backend, block_size, SINGLE)
    except ValueError as e:
        raise ValueError(f"speculative method 'mtp': {e}") from e


def _build(
    construct: Callable[[OperatorRuntime], nn.Module],
    model_config: ModelConfig,
    platform: Platform,
    attention_backend: str,
    block_size: int,
    tp: TensorParallel,
) -> BuiltModel:
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with (
            tensor_parallel_scope(tp),
            platform.model_build_context() as scope,
            torch.device(platform.device),
        ):
            runtime = OperatorRuntime(
                attention_backend,
                block_size,
                model_config.max_model_len,
                scope,
                layer_kernels(platform.layer_kernels()),
                model_config.kv_cache_dtype,
            )
            model = construct(runtime)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.to(platform.device)
    load_model(model, model_config, sharded=tp.size > 1)
    model.eval()

    if scope.collecting:
        operators, reason = scope.operators, None
    else:
        operators = [m for m in model.modules() if isinstance(m, MetadataOperator)]
        reason = f"platform {platform.name!r} does not collect operator metadata"
    # The operators the fallback serves: those without a builder, or all of them.
    orphans = operators if reason else [op for op in operators if op.metadata_builder() is None]
    fallback = lambda: compatibility_builder(model_config, block_size, orphans)
    plan = StepMetaPlan.from_operators(operators, fallback, fallback_reason=reason)
    if plan.fallback_reason:
        logger.warning("metadata plan uses the compatibility fallback: %s", plan.fallback_reason)
    return BuiltModel(model, plan)
