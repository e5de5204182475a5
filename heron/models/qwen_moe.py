"""Qwen2-MoE and Qwen3-MoE (the Qwen3-30B-A3B family): the Llama-family stack (Qwen2's qkv
bias, or Qwen3's q/k norm) whose MLPs are sparse MoE blocks, except where the config keeps a
dense one.

A layer is sparse unless it is in ``mlp_only_layers`` or falls between every
``decoder_sparse_step``-th layer, as in HF transformers. Qwen2-MoE's blocks add a shared expert
with a sigmoid gate (``SparseMoE.qwen`` reads that from the config).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from heron.kernels import LayerKernels
from heron.layers.moe import SparseMoE
from heron.models.common import DecoderForCausalLM
from heron.models.llama import LlamaFamily, LlamaModel, dense_mlp
from heron.ops.selector import OperatorRuntime


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    return (
        layer_idx not in (config.mlp_only_layers or ())
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


def qwen_moe_mlp(
    config: PretrainedConfig, family: LlamaFamily, layer_idx: int, kernels: LayerKernels
) -> nn.Module:
    if is_sparse_layer(config, layer_idx):
        return SparseMoE.qwen(config, kernels)
    return dense_mlp(config, family, layer_idx, kernels)


class QwenMoeForCausalLM(DecoderForCausalLM):
    """Per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj.weight``, as the released
    checkpoints and ``save_pretrained`` store them) and HF's stacked ones both load."""

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(config, LlamaModel(config, runtime, qwen_moe_mlp), runtime)
