"""gpt-oss checkpoints as published, with MXFP4 experts, from dense random ones; HF's model of
one (transformers dequantises MXFP4 itself on the CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heron.layers.mxfp4 import quantize_mxfp4

# What openai/gpt-oss-20b's config lists.
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def write_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` (a dense gpt-oss saved by HF) re-saved with its expert stacks as MXFP4
    ``*_blocks`` / ``*_scales``, output-major as the published checkpoints hold them (values
    rounded to MXFP4 by Heron's quantiser, which tests/layers/test_mxfp4_moe.py holds to
    transformers' dequantisation)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def hf_on_mxfp4(path: Path):
    """HF's model of an MXFP4 checkpoint (eager attention: sinks and windows). HF expands the
    experts to bf16, which holds every MXFP4 value exactly; widened to fp32, it computes as
    Heron's fp32 CPU path does."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    assert hf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    return hf.float().eval()
