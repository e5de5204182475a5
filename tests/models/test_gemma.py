"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random models.

Both interleave sliding-window and full layers; the prompts and generations are longer than
the windows, so a layer reading the wrong window (or the wrong group's view) shows up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams
from heron.cache.paged import SlidingWindowSpec
from heron.layers.norm import GemmaRMSNorm
from heron.metadata import StepMetaPlan

from tiny_models import BASE as TINY_BASE
from tiny_models import greedy_tokens, hf_greedy, hf_prompt_logprobs, make_tokenizer

MAX_NEW = 24
SLIDING, FULL = "sliding_attention", "full_attention"
# The first two share a 40-token prefix (prefix caching); all but the third are several
# windows long, and every generation crosses a window boundary.
PROMPTS = [
    list(range(10, 50)) + [7, 8, 9],
    list(range(10, 50)) + [200, 201, 202, 203, 204, 205, 206],
    [3, 4],
    [(i * 37) % 300 + 5 for i in range(70)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

# The tiny models' shape, tied; each Gemma sets its own depth.
BASE = {k: v for k, v in TINY_BASE.items() if k != "num_hidden_layers"} | {
    "tie_word_embeddings": True
}
GEMMA3_LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]


def gemma_config(family: str) -> tf.PretrainedConfig:
    if family == "gemma2":  # alternating layers (HF's default), both soft-caps biting
        return tf.Gemma2Config(
            **BASE,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=10.0,
        )
    if family == "gemma3":  # qk-norm, local/global RoPE (linear scaling on global)
        return tf.Gemma3TextConfig(
            **BASE,
            num_hidden_layers=6,
            head_dim=32,
            query_pre_attn_scalar=24,  # scale differs from head_dim ** -0.5
            sliding_window=12,
            layer_types=GEMMA3_LAYER_TYPES,
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
            final_logit_softcapping=15.0,
            # Ignored by HF's Gemma 3 attention; set so that Heron is seen to ignore it too.
            attn_logit_softcapping=2.0,
        )
    raise ValueError(family)


def save_gemma(family: str, path: Path) -> Path:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(gemma_config(family), dtype=torch.float32)
    # Random init is small and Gemma's norms are zero-centred; scale them so logits are not
    # near-uniform (the norms scale by 1 + w, here 1.5 to 2.5).
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """Factory: the saved directory of a tiny ``family`` model (built once per module)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save_gemma(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_case(request, gemma_dir):
    path = gemma_dir(request.param)
    # Eager attention: HF's SDPA path drops Gemma 2's attention soft-cap.
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    refs = hf_greedy(hf, PROMPTS, MAX_NEW)
    return str(path), hf, refs


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS, GREEDY)


def test_greedy_batch_equals_hf(gemma_case):
    path, _, refs = gemma_case
    llm = LLM(path, max_model_len=256, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs


def test_chunked_prefill_equals_hf(gemma_case):
    path, _, refs = gemma_case
    llm = LLM(path, max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs


def test_prefix_caching_keeps_parity(gemma_case):
    path, _, refs = gemma_case
    llm = LLM(path, max_model_len=256, enable_prefix_caching=True)
    assert _greedy_tokens(llm) == refs
    # Again: every prompt's full blocks are cached now, only the rest is computed.
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == refs
    assert outputs[0].num_cached_tokens == 32  # 43 tokens: two full blocks of 16
    assert llm.engine.kv_cache.prefix_cache_hits > 0


def test_preemption_keeps_parity(gemma_case):
    path, _, refs = gemma_case
    # 11 usable blocks of 16 tokens; the batch needs about 20 to run at once.
    llm = LLM(path, max_model_len=176, num_kv_blocks=12, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs
    assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_match_hf(gemma_case):
    path, hf, _ = gemma_case
    llm = LLM(path, max_model_len=256, max_num_batched_tokens=32)
    prompt = PROMPTS[3]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want = hf_prompt_logprobs(hf, prompt)
    assert (got - want).abs().max().item() <= 1e-3


def test_plan_has_a_sliding_and_a_full_group(gemma_case):
    path, hf, _ = gemma_case
    llm = LLM(path, max_model_len=256)
    plan = llm.engine.runner.plan
    assert plan.fallback_reason is None
    groups = {g.builder.sliding_window: g.layers for g in plan.groups}
    layer_types = hf.config.layer_types
    window = hf.config.sliding_window
    assert groups == {
        window: [
            f"model.layers.{i}.self_attn.attn" for i, t in enumerate(layer_types) if t == SLIDING
        ],
        None: [f"model.layers.{i}.self_attn.attn" for i, t in enumerate(layer_types) if t == FULL],
    }


def test_swapped_group_views_break_parity(gemma_case, monkeypatch):
    """Each operator reads its own group's view: handing the sliding layers the full group's
    view and the other way round must change the output."""
    path, _, refs = gemma_case
    build_views = StepMetaPlan.build_views

    def build_then_swap(self: StepMetaPlan, seq) -> None:
        build_views(self, seq)
        first, second = self.groups
        first.view, second.view = second.view, first.view

    llm = LLM(path, max_model_len=256, enable_prefix_caching=False)
    assert _greedy_tokens(llm) == refs
    monkeypatch.setattr(StepMetaPlan, "build_views", build_then_swap)
    assert _greedy_tokens(llm) != refs


def test_triton_operator_equals_hf(gemma_case):
    """The CUDA default operator run by Triton's interpreter on the CPU, on every layer: Gemma
    2's soft-capped logits and Gemma 3's (1 + w) qk-norm in the fused pre-write, sliding and
    full layers, chunked prefill mixed with decode. Fewer, shorter requests than the other
    tests (the interpreter is slow), still several windows long."""
    path, hf, _ = gemma_case
    prompts, new = [PROMPTS[0], PROMPTS[2], PROMPTS[3][:40]], 10
    llm = LLM(path, attention_backend="triton", max_model_len=256, max_num_batched_tokens=32)
    plan = llm.engine.runner.plan
    assert {g.builder.backend for g in plan.groups} == {"triton"}
    assert len(plan.groups) == 2
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, new)


def test_gemma_rms_norm_scales_in_fp32_like_hf():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(0)
    ours, theirs = GemmaRMSNorm(64), Gemma2RMSNorm(64)
    with torch.no_grad():
        theirs.weight.uniform_(-0.5, 0.5)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(5, 64).to(torch.bfloat16)
    residual = torch.randn(5, 64).to(torch.bfloat16)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, theirs(x + residual))


@pytest.mark.gpu
def test_greedy_on_cuda_with_graphs(gemma_case):
    """Two metadata groups, each with its graph buffers; windowed and full layers replayed, all
    on the Triton operator (Gemma 2's soft-cap, Gemma 3's qk-norm)."""
    path, _, refs = gemma_case
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        cuda_graph_max_bs=4,
        max_num_batched_tokens=32,
    )
    assert llm.engine.runner.graphs is not None and len(llm.engine.runner.plan.groups) == 2
    assert {g.builder.backend for g in llm.engine.runner.plan.groups} == {"triton"}
    assert _greedy_tokens(llm) == refs


def test_sliding_group_holds_only_the_window(gemma_dir):
    """A prompt many windows long, decoded well past it: parity with HF, while the sliding
    group's live blocks stay bounded by the window and the full group's grow with the sequence."""
    path = gemma_dir("gemma2")  # window 8; layers alternate sliding and full
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = [(i * 53) % 300 + 5 for i in range(60)]  # 7.5 windows
    max_new = 40
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    bs, chunk = 4, 16
    llm = LLM(str(path), max_model_len=256, block_size=bs, max_num_batched_tokens=chunk)
    engine, kv = llm.engine, llm.engine.kv_cache
    window = hf.config.sliding_window
    specs = engine.runner.cache_specs
    assert sorted(getattr(s, "sliding_window", 0) for s in specs) == [0, window]
    full_group, sliding_group = _full_and_sliding(specs)
    full, sliding = kv.groups[full_group], kv.groups[sliding_group]
    # Pools sized for the same number of max-length sequences; the sliding one is smaller.
    assert sliding.num_blocks < full.num_blocks
    bound = -(-(window + chunk) // bs) + 1
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    llm.add_request("long", prompt, params)
    request = engine.samples("long")[0]
    most_live, tokens = 0, []
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens = out.outputs[0].token_ids
        kv.check_invariants()
        if request.is_finished:
            break
        tables = kv.block_tables("long")
        full_table, sliding_table = tables[full_group], tables[sliding_group]
        live = sum(b != 0 for b in sliding_table)
        assert live <= bound
        assert all(b != 0 for b in full_table)
        assert len(full_table) == -(-(request.num_computed_tokens) // bs)
        assert sliding.num_free_blocks == sliding.num_blocks - 1 - live
        most_live = max(most_live, live)
    assert tokens == ref
    assert len(full_table) > 2 * bound  # the full group kept the whole history
    assert 0 < most_live <= bound
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv.usage == 0.0


def _full_and_sliding(specs) -> tuple[int, int]:
    """The indices of the full-attention and the sliding-window cache group."""
    (sliding,) = [i for i, s in enumerate(specs) if isinstance(s, SlidingWindowSpec)]
    return 1 - sliding, sliding


def test_kv_budget_fits_the_same_number_of_sequences_in_every_group(gemma_dir):
    path = gemma_dir("gemma2")  # 2 sliding (window 8) and 2 full layers, 2 KV heads of 16
    bs, chunk, max_len = 4, 16, 256
    per_block = 2 * 2 * bs * 2 * 16 * 4  # 2 layers, K and V, fp32
    b_full, b_sliding = max_len // bs, -(-(8 + chunk) // bs) + 1
    sequences = 3
    budget = sequences * (b_full + b_sliding) * per_block + 2 * per_block
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=budget,
        max_model_len=max_len,
        block_size=bs,
        max_num_batched_tokens=chunk,
        max_num_seqs=8,
    )
    kv = llm.engine.kv_cache
    runner = llm.engine.runner
    full_group, sliding_group = _full_and_sliding(runner.cache_specs)
    assert kv.groups[full_group].num_blocks == sequences * b_full + 1
    assert kv.groups[sliding_group].num_blocks == sequences * b_sliding + 1
    assert runner.cache.bytes_per_block() == [per_block, per_block]
    # Each operator's KV tensor is sized to its own group's pool.
    for op in runner.cache.owners:
        g = full_group if op.spec.sliding_window is None else sliding_group
        assert op.kv_cache.shape[1] == kv.groups[g].num_blocks
    # An explicit pool size applies to every group.
    llm = LLM(str(path), max_model_len=max_len, block_size=bs, num_kv_blocks=70)
    assert [g.num_blocks for g in llm.engine.kv_cache.groups] == [70, 70]


def test_triton_operator_covers_gemma_and_refuses_other_norms():
    """The Triton operator takes Gemma's soft-cap and (1 + w) qk-norm; a q/k norm whose form
    the fused pre-write does not know (no ``weight_offset``), or a mixed pair, is refused, and
    the selector gives such a layer the reference operator."""
    from heron.layers.norm import RMSNorm
    from heron.layers.rotary import QKTransform
    from heron.metadata import ModelBuildContext
    from heron.ops.attention.base import AttentionSpec
    from heron.ops.attention.reference import ReferenceAttention
    from heron.ops.attention.triton.operator import TritonAttention
    from heron.ops.selector import OperatorRuntime, make_attention

    spec = AttentionSpec(4, 2, 16, 0.25, sliding_window=8, logit_softcap=30.0)
    gemma = QKTransform(None, GemmaRMSNorm(16), GemmaRMSNorm(16))
    assert TritonAttention.covers(spec, gemma)
    with ModelBuildContext():
        TritonAttention("l.attn", spec, 16, 64, qk_transform=gemma)
    for transform in (
        QKTransform(None, torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)),
        QKTransform(None, RMSNorm(16), GemmaRMSNorm(16)),
        QKTransform(None, GemmaRMSNorm(16, eps=1e-6), GemmaRMSNorm(16, eps=1e-5)),
    ):
        assert not TritonAttention.covers(spec, transform)
        with ModelBuildContext(), pytest.raises(ValueError, match="does not implement"):
            TritonAttention("l.attn", spec, 16, 64, qk_transform=transform)
        with ModelBuildContext() as scope:
            runtime = OperatorRuntime("triton", 16, 64, scope)
            assert type(make_attention("l.attn", spec, runtime, transform)) is ReferenceAttention
