"""LoRA adapters against HF transformers + PEFT: one adapter, several adapters and the base
model in one batch, more adapters than slots, the prefix cache kept apart per adapter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from heron import LLM, LoRARequest, SamplingParams
from heron.kernels import TORCH_KERNELS, lora
from heron.ops import selector
from heron.platforms import CpuPlatform

from tiny_models import (
    cuda_graph_llm,
    edited_adapter_copy,
    hf_greedy,
    lora_tokens,
    peft_greedy,
    save_random_adapter,
)

MAX_NEW = 8
# The first two share a 32-token prefix (two full blocks: the prefix cache's unit).
PROMPTS = [
    list(range(10, 42)) + [7, 8, 9],
    list(range(10, 42)) + [200, 201],
    [3, 4, 5],
    [11, 12, 13, 14, 15] * 4,  # repeats: n-gram lookup proposes
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def case(tiny_model_dir, tmp_path_factory):
    """A Qwen3 model (qk-norm, packed qkv and gate_up), two adapters (every projection at
    rank 8; rsLoRA on three at rank 4) and each one's (and the base model's) greedy tokens
    from HF + PEFT."""
    base = tiny_model_dir("qwen3")
    tmp = tmp_path_factory.mktemp("adapters")
    a = save_random_adapter(base, tmp / "a", 1, 8, ALL, lora_alpha=16)
    b = save_random_adapter(
        base, tmp / "b", 2, 4, ["q_proj", "v_proj", "down_proj"], lora_alpha=8, use_rslora=True
    )
    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    refs = {
        "a": peft_greedy(base, a, PROMPTS, MAX_NEW),
        "b": peft_greedy(base, b, PROMPTS, MAX_NEW),
        None: hf_greedy(hf, PROMPTS, MAX_NEW),
    }
    assert refs["a"] != refs[None] and refs["b"] != refs[None]  # the adapters change outputs
    loras = {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b)), None: None}
    return base, loras, refs


def test_one_adapter_equals_peft(case):
    base, loras, refs = case
    llm = LLM(str(base), max_model_len=128, enable_lora=True, max_lora_rank=8)
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras["a"]] * len(PROMPTS)) == refs["a"]


def test_adapters_and_base_mixed_in_one_batch(case):
    """Each prompt under another adapter (or none), the shared prefix under two of them: each
    equals its adapter's run alone, twice (the second time from the prefix cache, which
    serves each prompt only blocks computed under its own adapter)."""
    base, loras, refs = case
    names = ["a", "b", None, "a"]
    want = [refs[n][i] for i, n in enumerate(names)]
    llm = LLM(str(base), max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want
    hits = llm.engine.kv_cache.prefix_cache_hits
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want
    assert llm.engine.kv_cache.prefix_cache_hits > hits
    # The shared prefix under the other adapter (and none) is not served from the cache.
    swapped = ["b", "a", None, None]
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in swapped]) == [
        refs[n][i] for i, n in enumerate(swapped)
    ]


def test_two_ranks_serve_adapters_mixed_in_one_batch(case):
    """Tensor parallelism: each rank holds its rows of B (column-parallel layers, per packed
    part) or its columns of A (row-parallel ones, the update summed with the base output)."""
    base, loras, refs = case
    names = ["a", "b", None, "a"]
    want = [refs[n][i] for i, n in enumerate(names)]
    with LLM(
        str(base), max_model_len=128, enable_lora=True, max_lora_rank=8, tensor_parallel_size=2
    ) as llm:
        assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want
        llm.engine.remove_lora(2)  # (read again on the ranks when asked for)
        assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want


def test_more_adapters_than_slots_run_over_several_steps(case):
    """One slot for two adapters, prompts prefilled in chunks of 16 tokens, a KV pool small
    enough that requests are preempted (and recomputed under their adapters)."""
    base, loras, refs = case
    names = ["b", "a", "b", None]
    llm = LLM(
        str(base),
        max_model_len=64,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        num_kv_blocks=6,
    )
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == [
        refs[n][i] for i, n in enumerate(names)
    ]
    assert llm.engine.scheduler.num_preemptions > 0


def test_ngram_speculation_verifies_under_each_adapter(case):
    base, loras, refs = case
    names = ["a", "b", None, "a"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    llm = LLM(
        str(base),
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        speculative_config=spec,
    )
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == [
        refs[n][i] for i, n in enumerate(names)
    ]
    assert llm.spec_decode_stats.num_draft_tokens > 0


def test_adapters_that_do_not_fit_are_refused_by_name(case, tmp_path):
    """Each refusal names its adapter and what does not fit; the other prompts run."""
    base, loras, refs = case
    b = loras["b"].lora_path
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    experts = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"
    wrong = {
        "rank": LoRARequest("rank", 3, loras["a"].lora_path),  # r=8 above max_lora_rank 4
        "dora": LoRARequest(
            "dora", 4, edited_adapter_copy(b, tmp_path / "d", {"use_dora": True}, id)
        ),
        "shape": LoRARequest(
            "shape",
            5,
            edited_adapter_copy(b, tmp_path / "s", {}, lambda t: t.update({key: t[key][:-1]})),
        ),
        "experts": LoRARequest(
            "experts",
            6,
            edited_adapter_copy(
                b,
                tmp_path / "e",
                {},
                lambda t: t.update({experts: t[key.replace("B", "A")].clone()}),
            ),
        ),
        "nan": LoRARequest(
            "nan",
            7,
            edited_adapter_copy(
                b, tmp_path / "n", {}, lambda t: t[key].view(-1)[3:4].fill_(float("nan"))
            ),
        ),
    }
    llm = LLM(str(base), max_model_len=128, enable_lora=True, max_lora_rank=4)
    outputs = llm.generate(
        [PROMPTS[0]] * 6, GREEDY, use_tqdm=False, lora_request=[*wrong.values(), loras["b"]]
    )
    errors = [o.error for o in outputs[:5]]
    assert "'rank'" in errors[0] and "r=8 is above max_lora_rank=4" in errors[0]
    assert "'dora'" in errors[1] and "use_dora" in errors[1]
    assert "'shape'" in errors[2] and "q_proj" in errors[2] and "do not fit" in errors[2]
    assert "'experts'" in errors[3] and "experts.0.gate_proj" in errors[3]
    assert "'nan'" in errors[4] and "q_proj" in errors[4] and "not finite" in errors[4]
    assert outputs[5].error is None and outputs[5].outputs[0].token_ids == refs["b"][0]
    with pytest.raises(ValueError, match="lora_int_id 2 is adapter 'b'"):
        llm.engine.add_lora(LoRARequest("other", 2, loras["a"].lora_path))

    base_only = LLM(str(base), max_model_len=128)
    (output,) = base_only.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=loras["a"])
    assert "enable_lora" in output.error


def test_adapters_on_the_lm_head_or_embeddings_are_refused_by_name(case, tmp_path):
    """PEFT's own adapters of ``lm_head`` and of ``embed_tokens`` (saved with the embedding):
    each refused naming its adapter and the module or tensor; a known adapter still runs."""
    base, loras, refs = case
    head = save_random_adapter(base, tmp_path / "head", 3, 4, ["q_proj", "lm_head"])
    embed = save_random_adapter(base, tmp_path / "embed", 4, 4, ["embed_tokens"])
    llm = LLM(str(base), max_model_len=128, enable_lora=True, max_lora_rank=8)
    requests = [LoRARequest("head", 3, str(head)), LoRARequest("embed", 4, str(embed))]
    outputs = llm.generate(
        [PROMPTS[0]] * 3, GREEDY, use_tqdm=False, lora_request=[*requests, loras["a"]]
    )
    head_error, embed_error = outputs[0].error, outputs[1].error
    # (The model ties its embeddings: PEFT saves the LM head's weight with its pair.)
    assert "'head'" in head_error and "lm_head" in head_error and "embeddings" in head_error
    assert "'embed'" in embed_error and "embed_tokens" in embed_error
    assert "embeddings" in embed_error
    assert outputs[2].error is None and outputs[2].outputs[0].token_ids == refs["a"][0]


def test_adapters_survive_sleep_and_a_weight_reload(case):
    """The slots' tables are kept through sleep (level 1; level 2 with the weights reloaded
    after wake-up), and adapters added or removed while asleep are read when next asked for."""
    base, loras, refs = case
    names = ["a", "b", None, "a"]
    requests = [loras[n] for n in names]
    want = [refs[n][i] for i, n in enumerate(names)]
    llm = LLM(
        str(base), max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8,
        enable_sleep_mode=True,
    )  # fmt: skip
    assert lora_tokens(llm, PROMPTS, GREEDY, requests) == want
    llm.sleep(level=1)
    llm.wake_up()
    assert lora_tokens(llm, PROMPTS, GREEDY, requests) == want
    llm.sleep(level=2)
    llm.engine.remove_lora(2)
    llm.engine.add_lora(loras["b"])
    llm.wake_up()
    assert llm.reload_weights() > 0
    assert lora_tokens(llm, PROMPTS, GREEDY, requests) == want


def test_triton_kernels_end_to_end_equal_peft(case, monkeypatch):
    """The LoRA layers on the Triton shrink/expand kernels (interpreted), two adapters and the
    base model in one batch."""
    base, loras, refs = case
    kernels = dataclasses.replace(
        TORCH_KERNELS, lora_shrink=lora.lora_shrink, lora_expand=lora.lora_expand
    )
    monkeypatch.setitem(selector.LAYER_KERNELS, "lora-triton", lambda: kernels)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "lora-triton")
    llm = LLM(str(base), max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    names = ["a", "b", None]
    prompts = [PROMPTS[2]] * 3
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=[loras[n] for n in names])
    assert [o.outputs[0].token_ids for o in outputs] == [refs[n][2][:3] for n in names]


@pytest.mark.gpu
def test_cuda_graphs_serve_any_mix_of_adapters(case):
    """fp32 on CUDA: decode graphs captured once (LoRA on the Triton kernels) replay steps of
    two adapters and the base model; outputs equal PEFT's."""
    base, loras, refs = case
    llm = cuda_graph_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    names = ["a", "b", None, "a"]
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == [
        refs[n][i] for i, n in enumerate(names)
    ]
    swapped = names[::-1]  # each prompt under another adapter, the same graphs
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in swapped]) == [
        refs[n][i] for i, n in enumerate(swapped)
    ]
