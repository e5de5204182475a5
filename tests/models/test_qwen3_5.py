"""Qwen3.5 (dense, text) against HF transformers on a tiny random model.

Gated-delta-rule layers carry each request's state across steps in its slot, so prompts longer
than a chunk, decode after prefill, preemption (a new slot, recomputed from zero) and batches
mixing all of these show up as a wrong token if a row reads another row's state or a stale one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from execution.view_replay import replay_views

from heron import LLM, SamplingParams
from heron.cache.paged import FullAttentionSpec
from heron.cache.recurrent import RecurrentStateSpec
from heron.ops.linear_attention import triton_operator
from heron.ops.linear_attention.operator import GatedDeltaNet

from tiny_models import BASE, greedy_tokens, hf_greedy, hf_prompt_logprobs, make_tokenizer

MAX_NEW = 12
LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = [LINEAR, LINEAR, FULL, LINEAR]
PROMPTS = [
    list(range(10, 50)) + [7, 8, 9],
    [3, 4],
    [(i * 37) % 300 + 5 for i in range(70)],
    [5],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def qwen3_5_config() -> tf.Qwen3_5TextConfig:
    return tf.Qwen3_5TextConfig(
        **{k: v for k, v in BASE.items() if k != "num_hidden_layers"},
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        head_dim=32,  # partial RoPE: a quarter of it rotates
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # q and k repeated to the value heads
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        tie_word_embeddings=True,
    )


def save_qwen3_5(path: Path) -> Path:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(qwen3_5_config(), dtype=torch.float32)
    randomize(model)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def randomize(model: torch.nn.Module) -> None:
    """Larger than HF's init so logits are not near-uniform; decays that keep a memory of
    several tokens (g = -A * softplus(a + dt_bias))."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.8, 1.2)
            else:  # (1 + w) norms, dt_bias
                p.uniform_(-0.5, 0.5)


@pytest.fixture(scope="module")
def qwen3_5_case(tmp_path_factory):
    path = save_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    return str(path), hf, hf_greedy(hf, PROMPTS, MAX_NEW)


def test_greedy_batch_equals_hf(qwen3_5_case):
    path, _, refs = qwen3_5_case
    llm = LLM(path, max_model_len=128)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    assert llm.engine.kv_cache.enable_prefix_caching


def test_chunked_prefill_and_preemption_equal_hf(qwen3_5_case):
    """Chunks of 16 tokens (long prompts continue from their saved state, mixed with decodes)
    over 6 usable blocks, fewer than the batch grows to: requests are preempted, recomputed
    from an empty state in a new slot, and every slot and block comes back."""
    path, _, refs = qwen3_5_case
    llm = LLM(path, max_model_len=96, max_num_batched_tokens=16, num_kv_blocks=7)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert all(g.num_free_blocks == g.num_blocks - 1 for g in kv.groups)


SHARED = [(i * 53) % 290 + 7 for i in range(37)]
SHARED_PROMPTS = [
    SHARED + [11, 12, 13],
    SHARED + [(i * 17) % 300 + 1 for i in range(20)],
    SHARED[:21] + [5, 6],
    SHARED + [2],
    [3, 4],
]


@pytest.fixture(scope="module")
def shared_prefix_refs(qwen3_5_case):
    return hf_greedy(qwen3_5_case[1], SHARED_PROMPTS, MAX_NEW)


def generate_shared_prefixes(path: str, **options) -> tuple[list[list[int]], list[int], LLM]:
    """Heron's tokens and cached prompt tokens for SHARED_PROMPTS, in chunks of 16, each prompt
    prefilled whole before the next starts (no fair-prefill split: a later prompt then finds
    the earlier one's checkpoints)."""
    llm = LLM(
        path,
        max_model_len=96,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=0,
        **options,
    )
    outs = llm.generate(SHARED_PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], llm


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefixes_with_chunks_and_preemption_equal_hf(
    qwen3_5_case, shared_prefix_refs, prefix_caching
):
    """Prompts sharing a prefix, in chunks of 16 over 8-token blocks and a pool tight enough to
    preempt: with prefix caching, later prompts start from a checkpointed state (at 32 tokens of
    the shared 37; at 16 for the one sharing 21) copied into their slot, and the tokens are
    HF's, as without it; every slot, checkpoint and block comes back."""
    tokens, cached, llm = generate_shared_prefixes(
        qwen3_5_case[0], block_size=8, num_kv_blocks=13, enable_prefix_caching=prefix_caching
    )
    assert tokens == shared_prefix_refs
    assert cached == ([0, 32, 16, 32, 0] if prefix_caching else [0] * 5)
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert all(g.num_free_blocks == g.num_blocks - 1 for g in kv.groups)


@pytest.mark.gpu
def test_shared_prefixes_on_the_gpu_with_graphs_equal_hf(qwen3_5_case, shared_prefix_refs):
    """fp32 on the GPU, CUDA graphs and Triton kernels: the checkpoint copies run beside graph
    replays, and hits still give HF's tokens."""
    tokens, cached, llm = generate_shared_prefixes(
        qwen3_5_case[0], device="cuda", dtype="float32", block_size=16, num_kv_blocks=32
    )
    assert llm.engine.runner.graphs is not None
    assert tokens == shared_prefix_refs and cached == [0, 32, 16, 32, 0]


def test_prompt_logprobs_match_hf(qwen3_5_case):
    path, hf, _ = qwen3_5_case
    llm = LLM(path, max_model_len=128, max_num_batched_tokens=32)
    prompt = PROMPTS[2]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    assert (got - hf_prompt_logprobs(hf, prompt)).abs().max().item() <= 1e-3


def test_plan_shows_the_attention_and_the_gdn_group(qwen3_5_case, capsys):
    from heron.cli import main

    path, _, _ = qwen3_5_case
    assert main(["plan", "--model", path, "--max-model-len", "128", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    full = [f"model.layers.{i}.self_attn.attn" for i, t in enumerate(LAYER_TYPES) if t == FULL]
    gdn = [f"model.layers.{i}.linear_attn.gdn" for i, t in enumerate(LAYER_TYPES) if t == LINEAR]
    by_builder = {g["builder"]: (g["layers"], g["cache_group"]) for g in plan["groups"]}
    caches = {c["spec"]["kind"]: (c["layers"], c["group"]) for c in plan["cache_groups"]}
    assert caches.keys() == {FullAttentionSpec.__name__, RecurrentStateSpec.__name__}
    assert (
        caches[RecurrentStateSpec.__name__][0] == gdn
        and caches[FullAttentionSpec.__name__][0] == full
    )
    assert by_builder["GatedDeltaNetBuilder(reference)"] == (
        gdn,
        caches[RecurrentStateSpec.__name__][1],
    )
    assert by_builder["PagedAttentionBuilder(reference)"] == (
        full,
        caches[FullAttentionSpec.__name__][1],
    )


@pytest.mark.parametrize("fused", [False, True])
def test_triton_operators_equal_hf(qwen3_5_case, fused, monkeypatch):
    """The CUDA default operators (Triton attention, Heron's GDN decode kernels: the conv's,
    the rule's and the norm's launches, or the fused one) run by Triton's interpreter on the
    CPU; decode steps continue from the states the prompts left (few, short requests: the
    interpreter is slow)."""
    path, _, refs = qwen3_5_case
    monkeypatch.setattr(triton_operator, "FUSED_MAX_VALUE_HEADS_PER_KEY", 2 if fused else 1)
    llm = LLM(path, attention_backend="triton", max_model_len=128)
    gdn = [m for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert {m._fuses_norm for m in gdn} == {fused}
    plan = llm.engine.runner.plan
    assert {g.builder.backend for g in plan.groups} == {"triton"}
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[3]]
    assert greedy_tokens(llm, prompts, short) == [refs[i][:5] for i in (1, 3)]


def test_triton_operators_with_speculation_equal_hf(qwen3_5_case):
    """Verification steps between the (interpreted) Triton GDN decode steps: each verified
    token's state is kept, the accepted one put back in the slot, and the kernels' decode steps
    continue from it with HF's tokens."""
    path, hf, refs = qwen3_5_case
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = LLM(path, attention_backend="triton", max_model_len=128, speculative_config=spec)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # the model's own continuation of [5], twice: some proposals are accepted, some refused
    repeated = (PROMPTS[3] + refs[3][:8]) * 2
    prompts = [PROMPTS[1], repeated]
    assert greedy_tokens(llm, prompts, short) == [refs[1][:8], *hf_greedy(hf, [repeated], 8)]
    stats = llm.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_verification_through_graph_buffers_equals_hf(qwen3_5_case):
    """Decode and verification steps as their graphs replay them (the buffers filled, the
    buckets' views; emulated on the CPU, see ``execution.view_replay``) on the interpreted
    Triton operators: HF's tokens, and capture's warm-up left every real slot alone."""
    path, hf, refs = qwen3_5_case
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = LLM(path, attention_backend="triton", max_model_len=128, speculative_config=spec)
    graphs = replay_views(llm)
    gdn = [m for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert all(not m.conv_state[1:].any() and not m.recurrent_state[1:].any() for m in gdn)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    repeated = (PROMPTS[3] + refs[3][:8]) * 2
    got = greedy_tokens(llm, [PROMPTS[1], repeated], short)
    assert got == [refs[1][:8], *hf_greedy(hf, [repeated], 8)]
    assert (2, 3) in graphs.replayed and (2, 1) in graphs.replayed  # both kinds, batch 2
    stats = llm.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.gpu
def test_speculation_on_the_gpu_equals_hf(qwen3_5_case):
    """On the GPU (fp32): n-gram speculation with verification steps replayed from their graphs
    (3 tokens per row, the GDN states kept per token in the reserved buffers) beside
    graph-replayed decode steps gives HF's tokens."""
    path, hf, refs = qwen3_5_case
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    options = dict(device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64)
    llm = LLM(path, cuda_graph_max_bs=8, speculative_config=spec, **options)
    graphs = llm.engine.runner.graphs
    assert graphs.query_lens == [1, 3]
    replayed = []
    run = graphs.run
    graphs.run = lambda seq: replayed.append(seq.max_query_len) or run(seq)
    repeated = (PROMPTS[3] + refs[3][:8]) * 2
    got = greedy_tokens(llm, [*PROMPTS, repeated], GREEDY)
    assert got == [*refs, *hf_greedy(hf, [repeated], MAX_NEW)]
    assert 3 in replayed
    stats = llm.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.gpu
@pytest.mark.parametrize("speculation", [None, 2])
def test_graph_replay_equals_eager_and_capture_leaves_real_slots_alone(qwen3_5_case, speculation):
    """On the GPU (fp32): decode steps replayed from CUDA graphs give HF's tokens, as eager
    steps do; capture and warm-up (of verification graphs too, with speculation) ran on the
    null slot only, so every other slot was still zero when the first request arrived."""
    path, _, refs = qwen3_5_case
    options = dict(device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64)
    if speculation:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculation}
    graphs = LLM(path, cuda_graph_max_bs=8, **options)
    runner = graphs.engine.runner
    assert runner.graphs is not None
    assert runner.graphs.query_lens == ([1, 1 + speculation] if speculation else [1])
    gdn = [m for m in runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert gdn and all(not m.conv_state[1:].any() and not m.recurrent_state[1:].any() for m in gdn)
    replayed = []
    run = runner.graphs.run
    runner.graphs.run = lambda seq: replayed.append(seq.num_reqs) or run(seq)
    assert greedy_tokens(graphs, PROMPTS, GREEDY) == refs
    assert replayed
    eager = LLM(path, enforce_eager=True, **options)
    assert greedy_tokens(eager, PROMPTS, GREEDY) == refs


@pytest.mark.gpu
def test_fla_prefill_equals_hf_with_chunked_prefill(qwen3_5_case, fla_chunk_rule):
    """On the GPU (fp32) with fla-core: every prefill and extend step (16-token chunks that
    continue from saved states, mixed with decodes) runs the batched fla path, and the tokens
    are HF's."""
    path, _, refs = qwen3_5_case
    llm = LLM(
        path, device="cuda", dtype="float32", max_model_len=128, max_num_batched_tokens=16,
        num_kv_blocks=64,
    )  # fmt: skip
    gdn = [m for m in llm.engine.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    calls = []
    for m in gdn:
        assert m._chunk_rule is fla_chunk_rule
        m._chunk_rule = lambda *args, **kwargs: calls.append(1) or fla_chunk_rule(*args, **kwargs)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == refs
    assert calls


@pytest.mark.gpu
def test_bf16_with_graphs_follows_fp32(qwen3_5_case):
    """bf16 on the GPU with graphs (Triton attention and GDN decode, PyTorch chunked prefill):
    where a request's tokens first leave HF's fp32 ones, Heron's token is in HF's top-5 there
    (DESIGN §5's near-tie rule)."""
    path, hf, refs = qwen3_5_case
    llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    assert llm.engine.runner.graphs is not None
    for prompt, want, got in zip(PROMPTS, refs, greedy_tokens(llm, PROMPTS, GREEDY)):
        i = next((i for i, (w, t) in enumerate(zip(want, got)) if w != t), None)
        if i is not None:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + want[:i]])).logits[0, -1]
            assert got[i] in logits.topk(5).indices.tolist(), (prompt, i)


def test_conditional_generation_checkpoint_serves_text(tmp_path):
    """A checkpoint as Qwen3.5 is released (vision tower beside the language model, names under
    model.language_model): on text, its prompt logprobs and greedy tokens equal HF's
    Qwen3_5ForConditionalGeneration (M-RoPE with three equal positions is plain RoPE)."""
    text = qwen3_5_config().to_dict()
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, num_position_embeddings=16,
    )  # fmt: skip
    config = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = tf.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompt = PROMPTS[0]
    with torch.no_grad():
        want_lps = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    llm = LLM(str(tmp_path), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist()
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    expected = want_lps[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - expected).abs().max().item() <= 1e-3


def moe_variant(config_cls, model_cls, seed: int, **fields) -> torch.nn.Module:
    """HF's ``model_cls``: the tiny shape with 4 experts (top 2) of width 32 and a shared
    expert of 48, larger random weights."""
    skip = {"model_type", "architectures", "transformers_version", "dtype"}
    shape = {
        k: v
        for k, v in qwen3_5_config().to_dict().items()
        if k in config_cls.__dataclass_fields__ and k not in skip
    }
    config = config_cls(
        **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, **fields,
    )  # fmt: skip
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    return model


def assert_chunked_greedy_equals_hf(model: torch.nn.Module, path: Path) -> None:
    """Saved, then run by Heron in 16-token chunks mixed with decode: HF's greedy tokens. The
    last prompt, admitted once the first one's second chunk ran, starts from its checkpointed
    state at 32 tokens (fair prefill off: each prompt prefills whole before the next starts)."""
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[0][:32] + [21, 22]]
    llm = LLM(
        str(path), max_model_len=128, max_num_batched_tokens=16, long_prefill_token_threshold=0
    )
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts, 8)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 32]


def test_qwen3_5_moe_equals_hf(tmp_path):
    """Qwen3.5-MoE: every MLP a sparse block (softmax top-2 of 4 experts, renormalised, and a
    sigmoid-gated shared expert)."""
    model = moe_variant(tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, seed=2)
    assert_chunked_greedy_equals_hf(model, tmp_path)


def test_qwen3_next_equals_hf(tmp_path):
    """Qwen3-Next: fused per-key-head interleaved in_proj_qkvz / in_proj_ba (two value heads
    per key head), sparse and dense MLPs alternating (decoder_sparse_step 2), unnormalised
    top-k weights."""
    model = moe_variant(
        tf.Qwen3NextConfig,
        tf.Qwen3NextForCausalLM,
        seed=3,
        decoder_sparse_step=2,
        norm_topk_prob=False,
    )
    mlps = {type(layer.mlp).__name__ for layer in model.model.layers}
    assert mlps == {"Qwen3NextMLP", "Qwen3NextSparseMoeBlock"}
    assert_chunked_greedy_equals_hf(model, tmp_path)
