"""Maps HF ``architectures`` names to Heron model classes."""

from __future__ import annotations

import logging

from torch import nn

from heron.models.deepseek import DeepseekForCausalLM, DeepseekMTP
from heron.models.gemma import GemmaForCausalLM
from heron.models.gemma3_mm import Gemma3ForConditionalGeneration
from heron.models.gpt_oss import GptOssForCausalLM
from heron.models.llama import LlamaForCausalLM
from heron.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MTP,
    Qwen3NextForCausalLM,
)
from heron.models.qwen3_vl import Qwen3VLForConditionalGeneration
from heron.models.qwen_moe import QwenMoeForCausalLM

logger = logging.getLogger(__name__)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}

# A target family -> the class of its multi-token-prediction head (speculative method "mtp");
# subclasses (MoE, multimodal, Qwen3-Next) have their base's.
MTP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    DeepseekForCausalLM: DeepseekMTP,
    Qwen3_5ForCausalLM: Qwen3_5MTP,
}


def register_model(architecture: str, cls: type[nn.Module]) -> None:
    """Serve checkpoints whose ``architectures`` names ``architecture`` with ``cls``, a model
    defined outside Heron (as vLLM's ``ModelRegistry.register_model``).

    ``cls(hf_config, runtime)`` builds the model inside the build scope (its metadata operators
    register there), ``forward(token_ids)`` returns hidden states and ``compute_logits(hidden)``
    the logits. An operator that declares no metadata builder runs on the compatibility
    fallback, which says so in ``heron plan`` and the start-up log.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_model: {cls!r} is not an nn.Module class")
    previous = MODEL_REGISTRY.get(architecture)
    if previous is not None and previous is not cls:
        logger.warning(
            "architecture %s: %s replaces %s", architecture, cls.__qualname__, previous.__qualname__
        )
    MODEL_REGISTRY[architecture] = cls


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


def mtp_class(architecture: str) -> type[nn.Module]:
    for cls in model_class(architecture).__mro__:
        if cls in MTP_CLASSES:
            return MTP_CLASSES[cls]
    families = ", ".join(sorted(c.__name__ for c in MTP_CLASSES))
    raise ValueError(
        f"speculative method 'mtp' is not supported for {architecture} (MTP heads: {families})"
    )
