"""Greedy decoding with n-gram speculation equals greedy decoding without it, token for token
(fp32, CPU; where the two part, HF's logits of the two tokens must tie to 1e-5), for every
family whose caches can roll back: dense, sliding window, interleaved
windows, gpt-oss sinks with MoE, Qwen MoE and DeepSeek's latent attention. Each engine runs with
chunked prefill and a pool small enough to preempt, twice over the same prompts (the second
run hits the prefix cache); the rollback invariants are checked after every step."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_deepseek import randomize as randomize_deepseek
from test_deepseek import v3_config
from test_gemma import save_gemma
from test_gpt_oss import randomize as randomize_gpt_oss
from test_gpt_oss import tiny_config as gpt_oss_config
from test_qwen3_5 import save_qwen3_5
from test_qwen_moe import tiny_config as qwen_moe_config

from heron import LLM, SamplingParams
from heron.cache.block_pool import ROOT_HASH, hash_block_tokens

from tiny_models import SHARED_PREFIX_PROMPTS, make_tokenizer, save_tiny_model

PROMPTS = [*SHARED_PREFIX_PROMPTS, [5, 6, 7, 8, 9] * 5 + [5, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# Chunked prefill, and a pool that cannot hold every sequence at once: preemption.
OPTIONS = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16)


def save_hf(model: torch.nn.Module, path):
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def save_family(family: str, path):
    torch.manual_seed(0)
    if family in ("llama", "qwen3", "mistral"):
        return save_tiny_model(family, path)
    if family == "gemma3":
        return save_gemma(family, path)
    if family == "gpt_oss":
        model = tf.GptOssForCausalLM(gpt_oss_config())
        randomize_gpt_oss(model)
        return save_hf(model, path)
    if family == "qwen3_5":
        return save_qwen3_5(path)
    if family == "deepseek_v3":
        model = tf.DeepseekV3ForCausalLM(v3_config())
        randomize_deepseek(model)
        return save_hf(model, path)
    model = tf.AutoModelForCausalLM.from_config(qwen_moe_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.02)
    return save_hf(model, path)


def assert_equal_up_to_exact_ties(path, got: list[list[int]], want: list[list[int]]) -> None:
    """A verification step and a decode step sum in different orders, so a token whose two
    best logits agree to rounding may differ: allowed only there, by HF's fp32 logits."""
    hf = None
    for prompt, a, b in zip(PROMPTS, got, want):
        if a == b:
            continue
        j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        hf = hf or tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + b[:j]])).logits[0, -1]
        gap = (logits[a[j]] - logits[b[j]]).abs().item()
        assert gap < 1e-5 * logits.abs().max().item(), (prompt, j, a[j], b[j], gap)


def check_rollback_invariants(llm: LLM) -> None:
    """No block is held twice or leaked (the pool's own checks); each running request holds
    blocks for its computed tokens at most (refused proposals gave theirs back), and hashes
    only blocks of known tokens, under those tokens' chain."""
    engine = llm.engine
    kv, bs = engine.kv_cache, engine.kv_cache.block_size
    kv.check_invariants()
    for request in engine.scheduler.running:
        known = request.all_token_ids
        for g in range(kv.num_groups):
            hashes = kv.groups[g].block_hashes(request.request_id)
            assert len(hashes) * bs <= len(known)
            parent = ROOT_HASH
            for i, h in enumerate(hashes):
                parent = hash_block_tokens(parent, known[i * bs : (i + 1) * bs])
                assert h == parent
            assert len(kv.block_table(request.request_id, g)) <= -(
                -request.num_computed_tokens // bs
            )


def check_runner_tables(llm: LLM, monkeypatch) -> None:
    """After every plan is applied, the runner's table rows are the scheduler's tables, with
    nothing past their ends (a shrunk table is cleared in the runner too)."""
    engine = llm.engine
    runner, kv = engine.runner, engine.kv_cache
    launch = runner.launch

    def checked(plan, previous=None, drafts=None):
        step = launch(plan, previous, drafts)
        tables = runner.inputs.tables
        for request_id in plan.request_ids:
            row = tables._row_of[request_id]
            for g in range(kv.num_groups):
                table, held = kv.block_table(request_id, g), tables.array[g, row]
                # (entries a window released are not followed: the runner never reads them)
                assert all(h == t for h, t in zip(held, table) if t)
                assert not held[len(table) :].any()
        return step

    monkeypatch.setattr(runner, "launch", checked)


def generate_checked(llm: LLM, prompts, params) -> list[list[int]]:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        llm.add_request(f"{id(prompts)}-{i}", prompt, params, stream=False)
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            done[output.request_id] = output.outputs[0].token_ids
        check_rollback_invariants(llm)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1  # nothing leaked
    return [done[f"{id(prompts)}-{i}"] for i in range(len(prompts))]


# family: KV pool size (a window-only model holds fewer blocks per sequence)
FAMILIES = {
    "llama": 40,
    "qwen3": 40,
    "mistral": 16,
    "gemma3": 40,
    "gpt_oss": 40,
    "qwen3_moe": 40,
    "deepseek_v3": 40,
    "qwen3_5": 40,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_speculation_equals_greedy_without(family, tmp_path, monkeypatch):
    path = str(save_family(family, tmp_path))
    options = dict(OPTIONS, num_kv_blocks=FAMILIES[family])
    plain = LLM(path, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(path, **options, speculative_config=SPECULATION)
    check_runner_tables(llm, monkeypatch)
    assert_equal_up_to_exact_ties(path, generate_checked(llm, PROMPTS, GREEDY), want)
    # again, from the prefix cache
    assert_equal_up_to_exact_ties(path, generate_checked(llm, PROMPTS, GREEDY), want)
    engine, stats = llm.engine, llm.engine.spec_decode_stats
    assert engine.kv_cache.prefix_cache_hits > 0
    assert engine.scheduler.num_preemptions > 0
    # proposals were made, some accepted and some refused (rolled back)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_uniform_proposals_keep_parity(tmp_path, monkeypatch):
    """As with verification graphs: once any row has proposals every decode row verifies
    ``k`` (padded), so verification steps without prefill rows have one query length."""
    path = str(save_family("gpt_oss", tmp_path))
    options = dict(OPTIONS, num_kv_blocks=FAMILIES["gpt_oss"])
    plain = LLM(path, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(path, **options, speculative_config=SPECULATION)
    monkeypatch.setattr(llm.engine.speculator, "uniform_up_to", 8)
    runner, uniform = llm.engine.runner, []
    launch = runner.launch

    def counted(plan, previous=None, drafts=None):
        if plan.draft_token_ids:
            uniform.append(len(set(plan.num_new)) == 1 and len(plan.num_new) > 1)
        return launch(plan, previous, drafts)

    monkeypatch.setattr(runner, "launch", counted)
    assert_equal_up_to_exact_ties(path, generate_checked(llm, PROMPTS, GREEDY), want)
    assert sum(uniform) >= 10


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_5"])
def test_verification_graphs_on_cuda(family, tmp_path):
    """fp32 on the GPU: verification steps replay their graphs (1 + k tokens per row) and give
    what eager verification gives, and greedy speculation stays plain greedy up to exact ties."""
    path = str(save_family(family, tmp_path))
    options = dict(device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64)
    plain = LLM(path, enforce_eager=True, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    eager = LLM(path, enforce_eager=True, speculative_config=SPECULATION, **options)
    eager_tokens = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(path, cuda_graph_max_bs=8, speculative_config=SPECULATION, **options)
    graphs = llm.engine.runner.graphs
    assert graphs.query_lens == [1, 1 + SPECULATION["num_speculative_tokens"]]
    assert llm.engine.runner.verify_graph_max_batch == 8
    replayed = []
    run = graphs.run
    graphs.run = lambda seq: replayed.append(seq.max_query_len) or run(seq)
    got = generate_checked(llm, PROMPTS, GREEDY)
    assert max(replayed) == 1 + SPECULATION["num_speculative_tokens"]
    assert_equal_up_to_exact_ties(path, got, want)
    assert_equal_up_to_exact_ties(path, eager_tokens, want)
