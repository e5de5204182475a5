"""Whole engine runs with the CUDA kernel set (Triton attention, RMSNorm, gated activation, GEMV,
MoE and the greedy argmax) under Triton's interpreter on the CPU, against HF transformers.

fp16, so that decode-sized products take the GEMV as they do in half precision on a GPU; HF runs
in fp32, so a greedy divergence must be a near-tie (each side's token in the other's top-5).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import transformers as tf
from test_gemma import save_gemma
from test_gpt_oss import randomize, tiny_config
from test_qwen3_5 import save_qwen3_5

from heron import LLM, SamplingParams
from heron.execution import sampler
from heron.kernels.argmax import greedy_argmax
from heron.ops import selector
from heron.ops.attention.base import AttentionOperator
from heron.ops.attention.triton import operator as triton_operator
from heron.ops.attention.triton.operator import TritonAttention
from heron.platforms import CpuPlatform

from tiny_models import make_tokenizer

# A short prompt and a chunked one: the second step decodes the first before the second's
# last chunk (a mixed step whose leading one-token row takes the decode kernel).
PROMPTS = [[3, 4], list(range(10, 50)) + [7, 8, 9]]
NEW = 4


def _save_gpt_oss(path):
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tiny_config())
    randomize(model)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def launches(monkeypatch):
    """Builds on the CPU platform take the CUDA platform's kernel set and sample greedy rows
    with the argmax kernel; counts each kernel family's calls."""
    counts = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    triton = selector.layer_kernels("triton")
    entries = ("rms_norm", "gated_activation", "gemv", "fused_experts", "route_topk")
    gemv = triton.gemv

    def gemv_counting_gates(*args, act=None, **kwargs):
        counts[f"gemv with {act}"] += 1
        return gemv(*args, act=act, **kwargs)

    triton = dataclasses.replace(triton, gemv=gemv_counting_gates)
    kernels = dataclasses.replace(triton, **{e: counted(e, getattr(triton, e)) for e in entries})
    monkeypatch.setitem(selector.LAYER_KERNELS, "counted", lambda: kernels)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "counted")
    monkeypatch.setattr(sampler, "_argmax", counted("argmax", greedy_argmax))
    for name in ("paged_decode_attention", "paged_extend_attention"):
        monkeypatch.setattr(triton_operator, name, counted(name, getattr(triton_operator, name)))
    return counts


def _heron_top5(llm: LLM, tokens: list[int]) -> list[int]:
    out = llm.generate(tokens, SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)[0]
    return list(out.outputs[0].logprobs[0].top)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gpt_oss", "qwen3_5"])
def test_cuda_kernel_set_equals_hf(family, tiny_model_dir, tmp_path, launches):
    """Qwen3: qk-norm fused in the KV write, SiLU; Gemma 2: soft-caps, GELU, post-norms fused
    into the next norm, a sliding and a full group; gpt-oss: sinks, windows, the fused MoE;
    Qwen3.5: GDN layers, gated attention reading [q|k|v] in place, its sigmoid gate in
    o_proj's GEMV."""
    if family == "qwen3":
        path = tiny_model_dir("qwen3")
    elif family == "gemma2":
        path = save_gemma("gemma2", tmp_path)
    elif family == "qwen3_5":
        path = save_qwen3_5(tmp_path)
    else:
        path = _save_gpt_oss(tmp_path)
    llm = LLM(
        str(path),
        attention_backend="triton",
        dtype="float16",
        max_model_len=128,
        max_num_batched_tokens=32,
    )
    ops = [m for m in llm.engine.runner.model.modules() if isinstance(m, AttentionOperator)]
    assert ops and all(type(op) is TritonAttention for op in ops)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    expected = {"rms_norm", "gemv", "argmax", "paged_decode_attention", "paged_extend_attention"}
    expected |= {"fused_experts", "route_topk"} if family == "gpt_oss" else {"gated_activation"}
    expected |= {"gemv with sigmoid"} if family == "qwen3_5" else set()
    assert expected <= {name for name, n in launches.items() if n}, launches

    # Eager attention: HF's SDPA path drops Gemma 2's attention soft-cap.
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for prompt, tokens in zip(PROMPTS, got):
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        i = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        if i is None:
            continue
        with torch.no_grad():
            hf_logits = hf(torch.tensor([prompt + want[:i]])).logits[0, -1]
        assert tokens[i] in hf_logits.topk(5).indices.tolist(), (prompt, tokens, want)
        assert want[i] in _heron_top5(llm, prompt + want[:i]), (prompt, tokens, want)
