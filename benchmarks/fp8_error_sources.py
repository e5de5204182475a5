"""Where FP8's error on the default model comes from, against the accuracy gates of
``tests/test_fp8_accuracy.py``: each E4M3 quantisation on its own, simulated in fp32 on HF's
model (everything else exact), scored as the test scores Heron (teacher-forced mean |delta
logprob| over HF fp32's greedy continuations) and given as a multiple of Heron's bf16 figure.

A simulated figure above its gate puts that gate out of the scheme's reach whatever the kernels
do (Heron's figure adds bf16's own rounding on top). CPU only, a few minutes:

    PYTHONPATH=$PWD python benchmarks/fp8_error_sources.py
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fp8_accuracy import GATES, heron_figure, hf_reference, teacher_forced  # noqa: E402

from heron.layers.fp8 import dequantize, quantize, to_fp8  # noqa: E402
from heron.loader.gguf import default_model_file, resolve_gguf  # noqa: E402

Rounding = Callable[[torch.Tensor], torch.Tensor]


def per_row(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with one scale per last-dimension row: a weight's output channel, an activation's
    token, a key's or value's token and head."""
    rows = x.reshape(-1, x.shape[-1])
    return dequantize(*quantize(rows)).view_as(x).to(x.dtype)


def per_head(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with one scale per head of a ``[batch, heads, tokens, head_dim]`` key or value, set
    by the prompt's own amax (as a scale computed from the prefill would be)."""
    heads = x.transpose(0, 1)
    return per_row(heads.reshape(heads.shape[0], -1)).view_as(heads).transpose(0, 1)


def per_tensor(w: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize(w, tuple(w.shape)), tuple(w.shape))


def per_group(size: int) -> Rounding:
    """E4M3 with one scale per ``size`` consecutive weights of a row (along K)."""
    return lambda w: dequantize(*quantize(w, (1, size)), (1, size))


def unit_scale(x: torch.Tensor) -> torch.Tensor:
    """E4M3 as the KV cache stores it without checkpoint scales."""
    return to_fp8(x).to(x.dtype)


def hadamard_rotated(x: torch.Tensor) -> torch.Tensor:
    """E4M3 of ``x H`` rotated back (``H`` the orthonormal Sylvester Hadamard matrix, its own
    inverse): what a cache of rotated keys gives a query rotated alike."""
    h = torch.ones(1, 1)
    while h.shape[0] < x.shape[-1]:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    h = h / h.shape[0] ** 0.5
    return unit_scale(x @ h) @ h


# name: (weights, activations) of every Linear but the LM head (embeddings, tied, stay exact).
LINEARS: dict[str, tuple[Rounding | None, Rounding | None]] = {
    "weights per tensor": (per_tensor, None),
    "weights per channel": (per_row, None),
    "weights per 128 along K": (per_group(128), None),
    "weights per 32 along K": (per_group(32), None),
    "activations per token": (None, per_row),
    "weights per channel + activations per token": (per_row, per_row),
}
# name: (keys, values) as attention reads them.
CACHES: dict[str, tuple[Rounding | None, Rounding | None]] = {
    "K, unit scale": (unit_scale, None),
    "V, unit scale": (None, unit_scale),
    "K and V, unit scale": (unit_scale, unit_scale),
    "K and V, per head": (per_head, per_head),
    "K and V, per token and head": (per_row, per_row),
    "K Hadamard-rotated, V unit scale": (hadamard_rotated, unit_scale),
}


def with_linears(hf: nn.Module, weights: Rounding | None, activations: Rounding | None):
    model = copy.deepcopy(hf)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            if weights is not None:
                module.weight.data = weights(module.weight.data)
            if activations is not None:
                module.register_forward_pre_hook(lambda _, args: (activations(args[0]),))
    return model


def with_cache(hf: nn.Module, keys: Rounding | None, values: Rounding | None):
    def attention(module, query, key, value, *args, **kwargs):
        key = key if keys is None else keys(key)
        value = value if values is None else values(value)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("fp8_cache", attention)
    model = copy.deepcopy(hf)
    model.set_attn_implementation("fp8_cache")
    return model


def figure(model: nn.Module, sequences) -> float:
    deltas = [(teacher_forced(model, s, n) - want).abs() for s, n, want in sequences]
    return torch.cat(deltas).mean().item()


def main() -> None:
    checkpoint = resolve_gguf(default_model_file())
    sequences = hf_reference(checkpoint)
    bf16 = heron_figure(checkpoint, sequences, "cpu", "bf16")
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    print(f"Heron bf16: {bf16:.6f}; gates: weights {GATES['fp8 weights']}x, KV {GATES['fp8 kv']}x")
    print(f"{'E4M3 in fp32 on HF, only':48} |dlogprob|  x bf16")
    runs = [(n, with_linears, r) for n, r in LINEARS.items()]
    runs += [(n, with_cache, r) for n, r in CACHES.items()]
    for name, build, roundings in runs:
        value = figure(build(hf, *roundings), sequences)
        print(f"{name:48} {value:9.6f}  {value / bf16:5.2f}", flush=True)


if __name__ == "__main__":
    main()
