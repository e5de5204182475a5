"""Qwen3-VL: the Qwen3 language model under interleaved M-RoPE, fed its vision tower's
features (with deepstack) at the image placeholders (:mod:`heron.models.vision_language`)."""

from __future__ import annotations

from functools import partial

from transformers import PretrainedConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from heron.layers.rotary import MRotaryEmbedding
from heron.models.common import DecoderForCausalLM
from heron.models.llama import LlamaModel
from heron.models.vision_language import ImagesIn, language_config
from heron.ops.selector import OperatorRuntime


class Qwen3VLForConditionalGeneration(ImagesIn, DecoderForCausalLM):
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        text_config = language_config(config)
        rotary = partial(MRotaryEmbedding, default_section=(24, 20, 20))  # (HF's default)
        super().__init__(
            text_config, LlamaModel(text_config, runtime, rotary_class=rotary), runtime
        )
        self.attach_vision(config, Qwen3VLVisionModel)
