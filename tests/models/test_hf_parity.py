"""Greedy outputs and prompt logprobs of Heron against HF transformers on tiny random models."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams

from tiny_models import (
    FAMILIES,
    first_divergence_is_a_near_tie,
    greedy_tokens,
    hf_greedy,
    hf_prompt_logprobs,
)

MAX_NEW = 24
# Different lengths; the first two share a 40-token prefix (prefix caching), the last crosses
# Mistral's 24-token sliding window several times.
PROMPTS = [
    list(range(10, 50)) + [7, 8, 9],
    list(range(10, 50)) + [200, 201, 202, 203, 204, 205, 206],
    [3, 4],
    [(i * 37) % 300 + 5 for i in range(70)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = hf_greedy(hf, PROMPTS, MAX_NEW)
    return path, hf, refs


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS, GREEDY)


def test_greedy_batch_equals_hf(family_case):
    path, _, refs = family_case
    llm = LLM(str(path), max_model_len=256, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs


def test_prefix_caching_reuses_blocks_and_keeps_parity(family_case):
    path, _, refs = family_case
    llm = LLM(str(path), max_model_len=256, enable_prefix_caching=True)
    assert _greedy_tokens(llm) == refs
    # Run again: every prompt's full blocks are now cached, only the rest is computed.
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == refs
    assert outputs[0].num_cached_tokens == 32  # 43 tokens: two full blocks of 16
    assert llm.engine.kv_cache.prefix_cache_hits > 0


def test_chunked_prefill_mixed_with_decode(family_case):
    path, _, refs = family_case
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=16)
    assert _greedy_tokens(llm) == refs


def test_preemption_under_memory_pressure(family_case):
    path, _, refs = family_case
    if "mistral" in str(path):
        # Every layer slides (window 24): a request holds at most ceil((24 + 16) / 16) + 1 = 4
        # blocks with 16-token chunks, so 5 usable blocks fit one request, not the batch.
        llm = LLM(
            str(path),
            max_model_len=176,
            num_kv_blocks=6,
            max_num_batched_tokens=16,
            enable_prefix_caching=False,
        )
        usable = 5
    else:
        # 11 usable blocks of 16 tokens; the batch needs about 20 to run at once.
        llm = LLM(str(path), max_model_len=176, num_kv_blocks=12, enable_prefix_caching=False)
        usable = 11
    assert _greedy_tokens(llm) == refs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.num_free_blocks == usable


def test_prompt_logprobs_match_hf(family_case):
    path, hf, _ = family_case
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=32)
    prompt = PROMPTS[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max().item() <= 1e-3
    top = out.prompt_logprobs[5].top
    assert set(top) == set(ref[4].topk(3).indices.tolist())


def test_prompt_logprobs_under_chunking_and_preemption(family_case):
    path, hf, refs = family_case
    # Mistral slides over every layer (window 24): a request holds at most
    # ceil((24 + 32) / 16) + 1 = 5 blocks, so it needs a smaller pool to be preempted.
    llm = LLM(
        str(path),
        max_model_len=176,
        num_kv_blocks=6 if "mistral" in str(path) else 12,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out, ref in zip(PROMPTS, outputs, refs):
        assert out.outputs[0].token_ids == ref
        assert len(out.prompt_logprobs) == len(prompt)
        want = hf_prompt_logprobs(hf, prompt)
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_on_cuda(family_case, dtype, graphs):
    """Triton operator (the CUDA default), chunked prefill mixed with decode, prefix caching."""
    path, _, refs = family_case
    llm = LLM(
        str(path),
        device="cuda",
        dtype=dtype,
        max_model_len=256,
        max_num_batched_tokens=32,
        num_kv_blocks=64,
        enforce_eager=not graphs,
        cuda_graph_max_bs=8,
    )
    assert (llm.engine.runner.graphs is not None) == graphs
    # The second run finds every prompt's full blocks cached, so its steps are batched
    # differently; in bf16 that changes roundings (a decode-sized product takes the GEMV, a
    # larger one cuBLAS), so each run is held to the near-tie rule rather than to the other.
    runs = [_greedy_tokens(llm), _greedy_tokens(llm)]
    if dtype == "float32":
        assert runs == [refs, refs]
        return
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for i, prompt in enumerate(PROMPTS):
        want = hf.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        for got in runs:
            assert first_divergence_is_a_near_tie(hf, prompt, got[i], want)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_triton_operator_equals_hf(family, tiny_model_dir):
    """The CUDA default operator (fused qk-norm/RoPE/KV write, split-K decode, varlen extend),
    run by Triton's interpreter on the CPU: chunked prefill, decode, Mistral's window."""
    path = tiny_model_dir(family)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3][:40]]
    new = 10
    refs = [
        hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    llm = LLM(str(path), attention_backend="triton", max_model_len=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == refs
