"""Filling a built model's parameters: from checkpoint files, or random (``dummy``)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from heron.config import ModelConfig
from heron.layers.mxfp4 import Mxfp4Scheme
from heron.layers.quantization import describe_weights
from heron.layers.wna16 import WNA16Scheme
from heron.loader.dummy import initialize_dummy_weights
from heron.loader.fp8 import fp8_expert_banks, fp8_linears, mxfp4_expert_banks
from heron.loader.safetensors import iterate_weights
from heron.loader.weights import load_weights

logger = logging.getLogger(__name__)


def load_model(model: nn.Module, model_config: ModelConfig, sharded: bool = False) -> None:
    """Fill ``model``; under an FP8 scheme its linear layers and SwiGLU experts end up holding
    FP8 weights: read as stored from an FP8 checkpoint, else quantised from the loaded (or
    dummy) weights (but those an operator reads as matrices, ``Linear.keep_dense``). Under an
    integer scheme (AWQ, GPTQ, compressed-tensors) linear layers and SwiGLU experts hold the
    packed weights as stored, or dummy weights quantised to the scheme. Under MXFP4 the
    experts hold the packed stacks as stored (dummy ones random).
    A ``sharded`` (tensor-parallel) model reads only its own parts of the checkpoint."""
    scheme = model_config.quantization
    if isinstance(scheme, Mxfp4Scheme):
        _load_mxfp4(model, model_config, sharded)
        return
    packed = isinstance(scheme, WNA16Scheme)
    linears = fp8_linears(model, scheme) if scheme is not None else []
    banks = fp8_expert_banks(model, scheme) if scheme is not None else []
    dummy = model_config.load_format == "dummy"
    as_stored = scheme is not None and (packed or scheme.from_checkpoint) and not dummy
    if as_stored:
        for layer in [*linears, *banks]:
            layer.hold_wna16(scheme) if packed else layer.hold_fp8(scheme.block)
    _fill(model, model_config, sharded)
    names = {m: n for n, m in model.named_modules()}
    for layer in linears:
        if packed and as_stored:
            layer.finish_wna16(model_config.dtype, names[layer])
        elif packed and not layer.keep_dense:
            layer.quantize_wna16(scheme)
        elif layer.keep_dense and as_stored:
            layer.dequantize_fp8(model_config.dtype)
        elif not layer.keep_dense and not as_stored:
            layer.quantize_fp8(scheme.block)
    for bank in banks:
        if packed and as_stored:
            bank.finish_wna16(names[bank])
        elif packed:
            bank.quantize_wna16(scheme)
        elif not as_stored:
            bank.quantize_fp8(scheme.block)
    logger.info("weights: %s", describe_weights(scheme, model))


def _load_mxfp4(model: nn.Module, model_config: ModelConfig, sharded: bool) -> None:
    """Fill ``model`` whose experts hold MXFP4 stacks (every other weight as stored)."""
    banks = mxfp4_expert_banks(model, model_config.quantization)
    for bank in banks.values():  # (gpt-oss builds its banks so from the config already)
        bank.hold_mxfp4()
    _fill(model, model_config, sharded)
    if model_config.load_format == "dummy":
        generator = torch.Generator(next(model.parameters()).device)
        generator.manual_seed(model_config.seed)
        for bank in banks.values():
            bank.randomize_mxfp4(_dummy_std(model_config), generator)
    logger.info("weights: %s", describe_weights(model_config.quantization, model))


def _dummy_std(model_config: ModelConfig) -> float:
    return getattr(model_config.hf_config, "initializer_range", None) or 0.02


def _fill(model: nn.Module, model_config: ModelConfig, sharded: bool) -> None:
    """The checkpoint's tensors (or dummy ones) into ``model``, in the layouts it holds."""
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, _dummy_std(model_config), model_config.seed)
    else:
        # A model reading part of the checkpoint (an MTP head) reads only the tensors it takes.
        lazy = sharded or getattr(model, "loads_prefixes_only", False)
        load_weights(model, iterate_weights(model_config.path, lazy=lazy))
    for module in model.modules():  # layouts of the loaded tensors that differ from the files'
        if hasattr(module, "finish_loading"):
            module.finish_loading()
