"""Accuracy gates of FP8 weights and the FP8 KV cache on the real default model
(SmolLM2-135M-Instruct) against HF transformers in fp32.

HF generates greedy continuations of real chat prompts (1,024 tokens in all); Heron then scores
each whole sequence teacher-forced (prompt logprobs) in bf16, with FP8 weights, with the FP8
KV cache and with both, and the mean |delta logprob| of the generated tokens against HF's is
compared with bf16's own. On the CPU the FP8 paths are the dequantising references; the
``gpu`` variant runs the Triton kernels and FP8 tensor cores.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_default_model import PROMPTS  # eight real chat prompts

from heron import LLM, SamplingParams
from heron.loader.gguf import default_model_file, resolve_gguf

NEW_TOKENS = 128  # 8 x 128 = 1,024 generated tokens
# (quantization, kv_cache_dtype) of each run, by name.
RUNS = {
    "bf16": (None, "auto"),
    "fp8 weights": ("fp8", "auto"),
    "fp8 kv": (None, "fp8"),
    "both": ("fp8", "fp8"),
}
# The gates, as multiples of bf16's figure.
GATES = {"fp8 weights": 3.0, "fp8 kv": 2.0}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The converted default model, and HF fp32's greedy continuation of each chat prompt with
    the log-probabilities it gives its own tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HERON_CACHE_DIR", str(tmp_path_factory.mktemp("heron-cache")))
        checkpoint = resolve_gguf(default_model_file())
    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # every prompt gets all NEW_TOKENS
    sequences = []
    for text in PROMPTS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0]
            logprobs = torch.log_softmax(hf(out[None]).logits[0].float(), -1)
        ids = out.tolist()
        scored = logprobs[torch.arange(len(prompt) - 1, len(ids) - 1), out[len(prompt) :]]
        sequences.append((ids, len(prompt), scored))
    return checkpoint, sequences


def mean_abs_delta(llm: LLM, sequences) -> float:
    """Mean |Heron's logprob - HF's| over every generated token, teacher-forced."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([ids for ids, _, _ in sequences], params, use_tqdm=False)
    deltas = []
    for out, (_, prompt_len, want) in zip(outputs, sequences):
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[prompt_len:]])
        deltas.append((got - want).abs())
    return torch.cat(deltas).mean().item()


def check_gates(device: str, reference) -> dict[str, float]:
    checkpoint, sequences = reference
    assert sum(len(s[2]) for s in sequences) >= 1000
    figures = {}
    for name, (quantization, kv_cache_dtype) in RUNS.items():
        llm = LLM(
            str(checkpoint),
            device=device,
            dtype="bfloat16",
            max_model_len=256,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=True,  # prompt logprobs run eagerly: no graphs to capture
        )
        figures[name] = mean_abs_delta(llm, sequences)
        del llm
    print(f"\nmean |delta logprob| vs HF fp32 on {device}: {figures}")
    for name, factor in GATES.items():
        assert figures[name] <= factor * figures["bf16"], figures
    return figures


@pytest.mark.slow
def test_fp8_accuracy_gates_on_the_cpu(reference):
    check_gates("cpu", reference)


@pytest.mark.slow
@pytest.mark.gpu
def test_fp8_accuracy_gates_on_the_gpu(reference):
    check_gates("cuda", reference)
