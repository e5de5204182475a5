"""Qwen3.5 (dense and MoE, text) and Qwen3-Next: gated-delta-rule layers interleaved with gated
full attention.

``layer_types`` names each layer ``linear_attention`` (a :class:`GatedDeltaNet` operator over
one recurrent state per request) or ``full_attention`` (paged attention whose output is gated
by a sigmoid of a second half of ``q_proj``; q/k norms of the ``(1 + w)`` form; partial RoPE).
The two operator kinds form two metadata groups and two cache groups.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from heron.kernels import LayerKernels
from heron.layers.activation import SigmoidAndMul, SiluAndMul
from heron.layers.embedding import VocabEmbedding
from heron.layers.linear import Linear, PackedLinear, Runs, rows_of
from heron.layers.mlp import GatedMLP
from heron.layers.moe import SparseMoE
from heron.layers.norm import GatedRMSNorm, GemmaRMSNorm
from heron.layers.rotary import MRotaryEmbedding, QKTransform, RotaryEmbedding
from heron.models.common import (
    PACKED_MODULES,
    DecoderForCausalLM,
    DecoderModel,
    attention_spec,
    head_dim_of,
    head_parallel_qkv,
    norm_with_residual,
)
from heron.models.mtp import MultiTokenPredictor, num_mtp_layers
from heron.models.qwen_moe import is_sparse_layer
from heron.models.vision_language import ImagesIn, language_config
from heron.ops.linear_attention.operator import GatedDeltaNetSpec
from heron.ops.selector import OperatorRuntime, make_attention, make_gated_delta_net

#: A layer's MLP from ``(config, layer index, kernels)``.
MLPFactory = Callable[[PretrainedConfig, int, LayerKernels], nn.Module]

_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gated_delta_net_spec(config: PretrainedConfig) -> GatedDeltaNetSpec:
    """The GDN layers' shape; the recurrent state is fp32 unless ``mamba_ssm_dtype`` says."""
    state_dtype = getattr(config, "mamba_ssm_dtype", None) or "float32"
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(
            f"unsupported mamba_ssm_dtype {state_dtype!r}; one of {list(_STATE_DTYPES)}"
        )
    return GatedDeltaNetSpec(
        num_key_heads=config.linear_num_key_heads,
        num_value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        state_dtype=_STATE_DTYPES[state_dtype],
    )


class GatedAttention(nn.Module):
    """Paged attention whose output is multiplied by ``sigmoid(gate)``; the checkpoint's
    ``q_proj`` yields, per head, the query then the gate (both ``head_dim`` wide), reordered
    after loading (``finish_loading``). Tensor-parallel by heads as the dense families'
    attention."""

    def __init__(
        self,
        config: PretrainedConfig,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
    ) -> None:
        super().__init__()
        spec = attention_spec(config)
        q_size, kernels = spec.num_heads * spec.head_dim, runtime.kernels
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj, spec = head_parallel_qkv(config.hidden_size, spec, bias, kernels, 2)
        self.o_proj = Linear(q_size, config.hidden_size, bias, kernels, parallel="row")
        self.output_gate = SigmoidAndMul(kernels)  # applied in o_proj's GEMV
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim  # this rank's heads
        # Registered before the operator (which holds them too): checkpoint names self_attn.*.
        self.q_norm = GemmaRMSNorm(spec.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, config.rms_norm_eps)
        transform = QKTransform(rotary, self.q_norm, self.k_norm)
        self.attn = make_attention(f"{prefix}.attn", spec, runtime, transform)

    def finish_loading(self) -> None:
        """The packed projection's rows from the checkpoint's per-head ``[query | gate]`` to
        ``[queries | k | v | gates]``: the operator reads ``[q | k | v]`` and the output
        projection the gates where the product leaves them, without copies."""
        self.qkv_proj.reorder_rows(self._loaded_order())

    def undo_finish_loading(self) -> None:
        """The checkpoint's row order again (a weight update writes rows where it has them)."""
        self.qkv_proj.reorder_rows(torch.argsort(self._loaded_order()))

    def _loaded_order(self) -> torch.Tensor:
        h, d, device = self.num_heads, self.head_dim, self.qkv_proj.weight.device
        heads = torch.arange(2 * h * d, device=device).view(h, 2, d)
        kv = torch.arange(2 * h * d, self.qkv_proj.out_features, device=device)
        return torch.cat([heads[:, 0].flatten(), kv, heads[:, 1].flatten()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        projected = self.qkv_proj(x)
        qkv, gate = projected[:, :-q_size], projected[:, -q_size:]
        return self.o_proj.forward_gated(gate, self.output_gate, up=self.attn(qkv))


def qkv_rows(spec: GatedDeltaNetSpec, first: int, count: int) -> Runs:
    """``(start, length)`` of the rows of ``[q | k | v]`` (a checkpoint's ``in_proj_qkv``, or
    the conv channels) that key heads ``[first, first + count)`` and their value heads use."""
    dk, dv = spec.key_dim, spec.num_value_heads // spec.num_key_heads * spec.value_dim
    keys = spec.num_key_heads * dk
    return (
        (first * dk, count * dk),
        (keys + first * dk, count * dk),
        (2 * keys + first * dv, count * dv),
    )


class KeyHeadParallel(PackedLinear):
    """A GDN input projection, column-parallel by key heads: each rank holds whole key heads'
    q and k and their value heads' v, z, b and a. ``per_key_head`` gives each shard's rows
    per key head."""

    def __init__(
        self,
        hidden_size: int,
        spec: GatedDeltaNetSpec,
        per_key_head: dict[str, int],
        kernels: LayerKernels,
    ) -> None:
        shards = {name: rows * spec.num_key_heads for name, rows in per_key_head.items()}
        super().__init__(
            hidden_size, shards, False, kernels, parallel="column", unit_rows=per_key_head
        )
        self.spec = spec
        name, rows = next(iter(per_key_head.items()))
        self.first_key_head = self.shard_starts[name] // rows
        self.key_heads = self.shard_offsets[name][1] // rows


class SplitInProj(KeyHeadParallel):
    """Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, packed."""

    def __init__(self, hidden_size: int, spec: GatedDeltaNetSpec, kernels: LayerKernels) -> None:
        per_key = spec.num_value_heads // spec.num_key_heads
        v_rows = per_key * spec.value_dim
        per_key_head = {"qkv": 2 * spec.key_dim + v_rows, "z": v_rows, "b": per_key, "a": per_key}
        super().__init__(hidden_size, spec, per_key_head, kernels)

    def shard_rows(self, shard: str) -> Runs:
        """A rank's q, k and v rows are three runs of ``in_proj_qkv``."""
        if shard != "qkv":
            return super().shard_rows(shard)
        return qkv_rows(self.spec, self.first_key_head, self.key_heads)


class InterleavedInProj(KeyHeadParallel):
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, which group rows by key head (per
    head: q, k, its value heads' v, then z; b then a), loaded into Qwen3.5's order
    ``[q | k | v | z | b | a]`` (each over the rank's heads), so one split serves both."""

    def __init__(self, hidden_size: int, spec: GatedDeltaNetSpec, kernels: LayerKernels) -> None:
        per_key = spec.num_value_heads // spec.num_key_heads
        qkvz = 2 * spec.key_dim + 2 * per_key * spec.value_dim
        super().__init__(hidden_size, spec, {"qkvz": qkvz, "ba": 2 * per_key}, kernels)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        s = self.spec
        per_key = s.num_value_heads // s.num_key_heads
        if shard == "qkvz":
            sizes = [s.key_dim, s.key_dim, per_key * s.value_dim, per_key * s.value_dim]
        else:
            sizes = [per_key, per_key]
        grouped = loaded.reshape(-1, sum(sizes), loaded.shape[-1]).split(sizes, dim=1)
        regrouped = torch.cat([part.reshape(-1, loaded.shape[-1]) for part in grouped])
        super().weight_loader(param, regrouped, shard)


class ConvWeights(nn.Module):
    """The depthwise conv1d's weight ``[channels, 1, kernel]`` (the operator convolves with it)
    for the channels ``runs`` of the checkpoint's ``[q | k | v]`` (this rank's heads)."""

    def __init__(self, spec: GatedDeltaNetSpec, runs: Runs) -> None:
        super().__init__()
        self.runs = runs
        channels = sum(length for _, length in runs)
        self.weight = nn.Parameter(torch.empty(channels, 1, spec.conv_kernel), requires_grad=False)

    def checkpoint_part(
        self, name: str, loaded: torch.Tensor, shard: None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return rows_of(loaded, self.runs)


#: The packed input projection of a GDN layer from ``(hidden_size, spec, kernels)``.
InProjFactory = Callable[[int, GatedDeltaNetSpec, LayerKernels], KeyHeadParallel]


class GatedDeltaNetMixer(nn.Module):
    """The linear-attention block: the packed input projection (``[qkv | z | b | a]`` after
    loading), the GDN operator, the gated norm with ``z`` and ``out_proj``.

    Tensor-parallel by key heads: each rank's operator runs its key heads and their value
    heads (its conv channels, ``A_log`` and ``dt_bias`` entries, recurrent states); the gated
    norm is per head, ``out_proj`` row-parallel (one all-reduce).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        runtime: OperatorRuntime,
        prefix: str,
        in_proj: InProjFactory = SplitInProj,
    ) -> None:
        super().__init__()
        whole = gated_delta_net_spec(config)
        self.in_proj = in_proj(config.hidden_size, whole, runtime.kernels)
        first, count = self.in_proj.first_key_head, self.in_proj.key_heads
        per_key = whole.num_value_heads // whole.num_key_heads
        spec = dataclasses.replace(whole, num_key_heads=count, num_value_heads=count * per_key)
        self.spec, self.first_value_head = spec, first * per_key
        heads = spec.num_value_heads
        # Registered before the operator (which holds them too): checkpoint names linear_attn.*.
        self.conv1d = ConvWeights(spec, qkv_rows(whole, first, count))
        self.dt_bias = nn.Parameter(torch.ones(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.norm = GatedRMSNorm(spec.value_dim, config.rms_norm_eps, runtime.kernels)
        self.out_proj = Linear(
            whole.num_value_heads * whole.value_dim, config.hidden_size, False, runtime.kernels,
            parallel="row",
        )  # fmt: skip
        self.gdn = make_gated_delta_net(
            f"{prefix}.gdn", spec, runtime, self.conv1d.weight, self.A_log, self.dt_bias
        )

    def checkpoint_part(self, name: str, loaded: torch.Tensor, shard: None) -> torch.Tensor:
        """This rank's value heads of ``A_log`` and ``dt_bias``."""
        return loaded.narrow(0, self.first_value_head, self.spec.num_value_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        heads, value_size = spec.num_value_heads, spec.num_value_heads * spec.value_dim
        qkv, z, b, a = self.in_proj(x).split([spec.conv_dim, value_size, heads, heads], dim=-1)
        out = self.gdn(qkv, a, b, z, self.norm)  # normed: [tokens, heads, value_dim]
        return self.out_proj(out.reshape(x.shape[0], value_size))


class Qwen3_5DecoderLayer(nn.Module):
    """norm -> token mixer (``linear_attn`` or ``self_attn``) -> +residual, norm -> MLP."""

    output_norm = None  # see DecoderModel

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        runtime: OperatorRuntime,
        prefix: str,
        mlp: MLPFactory,
        in_proj: InProjFactory,
    ) -> None:
        super().__init__()
        eps, kernels = config.rms_norm_eps, runtime.kernels
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, kernels)
        layer_type = config.layer_types[layer_idx]
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNetMixer(config, runtime, f"{prefix}.linear_attn", in_proj)
            self.mixer = self.linear_attn
        elif layer_type == "full_attention":
            self.self_attn = GatedAttention(config, rotary, runtime, f"{prefix}.self_attn")
            self.mixer = self.self_attn
        else:
            raise ValueError(f"layer {layer_idx}: unsupported layer type {layer_type!r}")
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, kernels)
        self.mlp = mlp(config, layer_idx, kernels)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, prenorm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm_with_residual(self.input_layernorm, x, residual, prenorm)
        x, residual = self.post_attention_layernorm(self.mixer(x), residual)
        return self.mlp(x), residual


def dense_mlp(config: PretrainedConfig, layer_idx: int, kernels: LayerKernels) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, SiluAndMul, False, kernels)


def sparse_mlp(config: PretrainedConfig, layer_idx: int, kernels: LayerKernels) -> nn.Module:
    """Qwen3.5-MoE's block on every layer: softmax top-k over the experts (weights
    renormalised), and a sigmoid-gated shared expert."""
    return SparseMoE.qwen(config, kernels)


def qwen3_next_mlp(config: PretrainedConfig, layer_idx: int, kernels: LayerKernels) -> nn.Module:
    """The sparse block where ``decoder_sparse_step`` / ``mlp_only_layers`` put one, else a
    dense MLP (as HF's Qwen3-Next)."""
    if is_sparse_layer(config, layer_idx):
        return SparseMoE.qwen(config, kernels)
    return dense_mlp(config, layer_idx, kernels)


class Qwen3_5Model(DecoderModel):
    def __init__(
        self,
        config: PretrainedConfig,
        runtime: OperatorRuntime,
        mlp: MLPFactory = dense_mlp,
        in_proj: InProjFactory = SplitInProj,
        rotary_class: type[RotaryEmbedding] = RotaryEmbedding,
    ) -> None:
        super().__init__()
        rotary = rotary_class(config, head_dim_of(config), runtime.max_model_len)
        self.rotary = rotary
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, i, rotary, runtime, f"model.layers.{i}", mlp, in_proj)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, runtime.kernels)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    checkpoint_prefixes = {"mtp.": None}  # the multi-token-prediction head: Qwen3_5MTP's
    packed_modules = PACKED_MODULES | {
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }
    mlp: MLPFactory = staticmethod(dense_mlp)
    in_proj: InProjFactory = staticmethod(SplitInProj)
    rotary_class: type[RotaryEmbedding] = RotaryEmbedding

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        model = Qwen3_5Model(config, runtime, self.mlp, self.in_proj, self.rotary_class)
        super().__init__(config, model, runtime)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP is the sparse block (experts stacked as HF stores them,
    or one tensor per expert)."""

    mlp = staticmethod(sparse_mlp)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: the same layers with fused, per-key-head interleaved input projections, and
    sparse MLPs where the config puts them."""

    packed_modules = PACKED_MODULES | {
        "in_proj_qkvz": ("in_proj", "qkvz"),
        "in_proj_ba": ("in_proj", "ba"),
    }
    mlp = staticmethod(qwen3_next_mlp)
    in_proj = staticmethod(InterleavedInProj)


class Qwen3_5ForConditionalGeneration(ImagesIn, Qwen3_5ForCausalLM):
    """A Qwen3.5 checkpoint as released: the language model under interleaved M-RoPE and the
    vision tower (:mod:`heron.models.vision_language`); the multi-token-prediction head is
    Qwen3_5MTP's."""

    checkpoint_prefixes = {
        "model.language_model.": "model.",
        "model.visual.": "visual.",
        "mtp.": None,
    }
    rotary_class = staticmethod(partial(MRotaryEmbedding, default_section=(11, 11, 10)))
    vision_tower: type[nn.Module] = Qwen3_5VisionModel

    def __init__(self, config: PretrainedConfig, runtime: OperatorRuntime) -> None:
        super().__init__(language_config(config), runtime)
        self.attach_vision(config, self.vision_tower)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    mlp = staticmethod(sparse_mlp)
    vision_tower = Qwen3_5MoeVisionModel


class Qwen3_5MTP(MultiTokenPredictor):
    """Qwen3.5 / Qwen3-Next's MTP head (``mtp.*``): ``pre_fc_norm_embedding`` and
    ``pre_fc_norm_hidden``, their projection ``fc``, the first of the
    ``mtp_num_hidden_layers`` full-attention decoder layers (``mtp.layers.0``, with the
    target's MLP kind for layer index 0) and the output norm ``norm``."""

    def __init__(self, target: Qwen3_5ForCausalLM, runtime: OperatorRuntime) -> None:
        super().__init__(target)
        self.packed_modules = target.packed_modules
        config = copy.copy(target.config)
        count = num_mtp_layers(config, "mtp_num_hidden_layers")
        config.layer_types = ["full_attention"]
        eps, kernels, hidden = config.rms_norm_eps, runtime.kernels, config.hidden_size
        mtp = nn.Module()
        mtp.rotary = RotaryEmbedding(config, head_dim_of(config), runtime.max_model_len)
        mtp.pre_fc_norm_embedding = GemmaRMSNorm(hidden, eps, kernels)
        mtp.pre_fc_norm_hidden = GemmaRMSNorm(hidden, eps, kernels)
        mtp.fc = Linear(2 * hidden, hidden, False, kernels)
        layer = Qwen3_5DecoderLayer(
            config, 0, mtp.rotary, runtime, "mtp.layers.0", target.mlp, target.in_proj
        )
        mtp.layers = nn.ModuleList([layer])
        mtp.norm = GemmaRMSNorm(hidden, eps, kernels)
        self.mtp = mtp
        self.checkpoint_prefixes = {f"mtp.layers.{i}.": None for i in range(1, count)}
        self.checkpoint_prefixes["mtp."] = "mtp."
        self.parts = (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, layer, mtp.norm)
