"""LoRA on MoE experts (PEFT's ``target_parameters`` on the stacked ``gate_up_proj`` and
``down_proj``, and PEFT's rewrite of gate/up/down targets into them) and on DeepSeek's latent
projections (``kv_b_proj``'s absorbed into the latent attention), against HF transformers +
PEFT on tiny random Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE and DeepSeek-V3 models: one adapter;
adapters and the base model mixed in one batch; more adapters than slots with chunked prefill
and preemption; the prefix cache; two tensor-parallel ranks; the Triton kernels (interpreted);
and the bank's and kv_b_proj's updates against dense products."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace
from unittest import mock

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from execution.view_replay import replay_views

from heron import LLM, LoRARequest, SamplingParams
from heron.kernels import TORCH_KERNELS, lora
from heron.kernels.moe import fused_experts
from heron.layers.linear import Linear
from heron.layers.moe import SwiGLUExperts
from heron.lora.adapter import LoRAPair
from heron.lora.builder import LoRAView
from heron.lora.config import LoRAConfig
from heron.lora.experts import LoRAExperts
from heron.lora.latent import LoRALatent
from heron.metadata import ModelBuildContext
from heron.ops import selector
from heron.ops.mla.base import MLASpec
from heron.platforms import CpuPlatform

from tiny_models import (
    BASE,
    QWEN3_5,
    cuda_graph_llm,
    edited_adapter_copy,
    hf_greedy,
    lora_tokens,
    peft_greedy,
    save_random_adapter,
    save_random_model,
)

MAX_NEW = 6
PROMPTS = [list(range(10, 30)) + [7, 8], [3, 4, 5], [11, 12, 13, 14, 15] * 2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
LATENT = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "kv_b_proj"]
SMALL = BASE | dict(num_hidden_layers=2, tie_word_embeddings=False)


def _configs() -> dict:
    """Qwen3-MoE (a dense layer after a sparse one), Qwen2-MoE (qkv bias, a sigmoid-gated
    shared expert) and DeepSeek-V3 (a dense layer, then routed experts and a shared one; the
    low-rank query)."""
    return {
        "qwen2_moe": tf.Qwen2MoeConfig(
            **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
        "qwen3_moe": tf.Qwen3MoeConfig(
            **SMALL, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
        ),
        "deepseek_v3": tf.DeepseekV3Config(
            **SMALL | dict(num_key_value_heads=4), first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
            n_shared_experts=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12,
        ),
    }  # fmt: skip


MLP = ["gate_proj", "up_proj", "down_proj"]
# Per family: two adapters' (rank, target modules, other LoraConfig options); the stacked
# experts are PEFT's target_parameters. The second targets one stack only (PEFT then nests no
# wrappers). The first's gate/up/down targets are the dense MLP's and DeepSeek's shared
# experts' (see _v4_targets_kept).
ADAPTERS = {
    "qwen3_moe": (
        (8, ["q_proj", "v_proj", "o_proj", *MLP], dict(target_parameters=EXPERTS, lora_alpha=16)),
        (4, ["k_proj"], dict(target_parameters=EXPERTS[1:], lora_alpha=8, use_rslora=True)),
    ),
    "qwen2_moe": (
        (8, ["q_proj", "o_proj", *MLP], dict(target_parameters=EXPERTS, lora_alpha=16)),
        (4, ["v_proj"], dict(target_parameters=EXPERTS[:1], lora_alpha=8)),
    ),
    "deepseek_v3": (
        (8, LATENT + MLP, dict(target_parameters=EXPERTS, lora_alpha=16)),
        (4, LATENT[1:3], dict(target_parameters=EXPERTS[:1], lora_alpha=8)),
    ),
}


@contextlib.contextmanager
def _v4_targets_kept():
    """PEFT under transformers 5 rewrites gate/up/down targets of these MoE models as if they
    named transformers 4's per-expert modules (into the stacked experts at twice the rank, a
    rank_pattern, dropping the dense and shared MLPs'); with its conversion off they target
    the dense and shared MLPs' linear layers, as written."""
    with mock.patch(
        "peft.utils.transformers_weight_conversion.get_checkpoint_conversion_mapping",
        return_value=None,
    ):
        yield


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def case(request, tmp_path_factory):
    """The saved model, its two adapters and each one's (and the base's) greedy tokens."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    base = save_random_model(_configs()[family], tmp / "base")
    with _v4_targets_kept():
        paths = [
            save_random_adapter(base, tmp / name, seed, r, targets, **options)
            for seed, (name, (r, targets, options)) in enumerate(zip("ab", ADAPTERS[family]), 1)
        ]
        refs = {n: peft_greedy(base, p, PROMPTS, MAX_NEW) for n, p in zip("ab", paths)}
    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    refs[None] = hf_greedy(hf, PROMPTS, MAX_NEW)
    assert refs["a"] != refs[None] and refs["b"] != refs[None]  # the adapters change outputs
    loras = {n: LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(zip("ab", paths), 1)}
    return base, loras | {None: None}, refs


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "deepseek_v3"], indirect=True)
def test_one_adapter_equals_peft(case):
    base, loras, refs = case
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_lora_rank=8)
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras["a"]] * len(PROMPTS)) == refs["a"]


def test_adapters_and_base_mixed_in_one_batch(case):
    base, loras, refs = case
    names = ["a", "b", None]
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == [
        refs[n][i] for i, n in enumerate(names)
    ]
    swapped = ["b", None, "a"]
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in swapped]) == [
        refs[n][i] for i, n in enumerate(swapped)
    ]


TRITON = dataclasses.replace(
    TORCH_KERNELS,
    fused_experts=fused_experts,
    lora_shrink=lora.lora_shrink,
    lora_expand=lora.lora_expand,
)


@pytest.mark.parametrize("kernels", [TORCH_KERNELS, TRITON], ids=["torch", "triton"])
def test_expert_updates_equal_dense_per_pair(kernels):
    """A bank's routed pairs each get their token's adapter's update of their expert: the
    PyTorch reference path, and the fused Triton experts with the shrink/expand kernels over
    (slot, expert) entries (interpreted), against a dense fp32 loop over (token, expert)."""
    torch.manual_seed(0)
    e, hidden, inter, top_k = 4, 32, 24, 2
    slots = [2, 0, 1, 2, 1, 0, 2]
    with ModelBuildContext():
        bank = SwiGLUExperts(e, hidden, inter, kernels)
        bank.lora = LoRAExperts("experts.lora", bank, LoRAConfig(max_loras=3, max_lora_rank=8))
    bank.gate_up_proj.data.normal_(0, 0.2)
    bank.down_proj.data.normal_(0, 0.2)

    def pair(r, n_in, n_out):
        return LoRAPair(torch.randn(e, r, n_in) * 0.3, torch.randn(e, n_out, r) * 0.3)

    adapters = {  # slot 1: rank 8 on both stacks; slot 2: rank 4 on down only; slot 3: unused
        1: {"gate_up_proj": pair(8, hidden, 2 * inter), "down_proj": pair(8, inter, hidden)},
        2: {"down_proj": pair(4, inter, hidden)},
        3: {"gate_up_proj": pair(8, hidden, 2 * inter)},
    }
    for slot, pairs in adapters.items():
        bank.lora.set_slot(slot, pairs)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    bank.lora.bind(SimpleNamespace(view=LoRAView(token_slots, None)))
    x = torch.randn(len(slots), hidden)
    weights = torch.rand(len(slots), top_k)
    indices = torch.stack([torch.randperm(e)[:top_k] for _ in slots])

    want = torch.zeros_like(x)
    for t, s in enumerate(slots):
        for j in range(top_k):
            ex = int(indices[t, j])
            # Each stack's weight plus the pair's product (B A), or the weight alone.
            w = {k: getattr(bank, k)[ex].T for k in ("gate_up_proj", "down_proj")}
            for k, v in adapters.get(s, {}).items():
                w[k] = w[k] + v.a[ex].T @ v.b[ex].T
            gate, up = (x[t] @ w["gate_up_proj"]).chunk(2)
            want[t] += weights[t, j] * ((F.silu(gate) * up) @ w["down_proj"])
    torch.testing.assert_close(bank(x, weights, indices), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", [TORCH_KERNELS, TRITON], ids=["torch", "triton"])
def test_kv_b_updates_absorbed_equal_the_updated_weight(kernels):
    """The latent attention's reads of kv_b_proj under each token's adapter (the query's
    absorption of W_UK, W_UV on the attention's latents, a request's keys and values
    decompressed) equal the same products with each slot's whole weight W + B A, dense in
    fp32: the PyTorch gather and the shrink/expand kernels over (slot, head) rows
    (interpreted)."""
    torch.manual_seed(0)
    heads, lora_rank, nope, v = 3, 32, 16, 12
    spec = MLASpec(heads, lora_rank, nope, 8, v, 1.0)
    slots = [2, 0, 1, 2, 1]
    with ModelBuildContext():
        kv_b = Linear(lora_rank, heads * (nope + v), False, kernels)
        kv_b.lora = LoRALatent("kv_b_proj.lora", kv_b, spec, LoRAConfig(3, 8))
    kv_b.weight.data.normal_(0, 0.2)
    pairs = {  # slot 3 holds an adapter no token uses
        s: LoRAPair(torch.randn(r, lora_rank) * 0.3, torch.randn(heads * (nope + v), r) * 0.3)
        for s, r in ((1, 8), (2, 4), (3, 8))
    }
    for slot, pair in pairs.items():
        kv_b.lora.set_slot(slot, {None: pair})
    kv_b.lora.bind(SimpleNamespace(view=LoRAView(torch.tensor(slots, dtype=torch.int32), None)))
    # Each token's [W_UK; W_UV] per head, the update added.
    w = torch.stack([
        kv_b.weight + (pairs[s].b @ pairs[s].a if s else 0) for s in slots
    ]).view(len(slots), heads, nope + v, lora_rank)  # fmt: skip
    base_w = kv_b.weight.view(heads, nope + v, lora_rank)

    q_nope = torch.randn(len(slots), heads, nope)
    q = torch.cat([torch.einsum("thn,hnl->thl", q_nope, base_w[:, :nope]), torch.ones(5, 3, 8)], -1)
    kv_b.lora.absorb_query(q_nope, q)
    want = torch.einsum("thn,thnl->thl", q_nope, w[:, :, :nope])
    torch.testing.assert_close(q, torch.cat([want, torch.ones(5, 3, 8)], -1))

    latent_out = torch.randn(len(slots), heads, lora_rank)
    values = torch.einsum("thl,hvl->thv", latent_out, base_w[:, nope:])
    got = kv_b.lora.expand_values(latent_out, values)
    want = torch.einsum("thl,thvl->thv", latent_out, w[:, :, nope:])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    latent = torch.randn(7, lora_rank)  # a request's cached latents, its first token's slot 2
    got = kv_b.lora.decompress(latent, latent @ kv_b.weight.T, 0)
    torch.testing.assert_close(got, latent @ w[0].flatten(0, 1).T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["qwen3_moe"], indirect=True)
def test_triton_kernels_end_to_end_equal_peft(case, monkeypatch):
    """The fused experts and the LoRA shrink/expand kernels (interpreted) serving two
    adapters and the base model in one batch (DeepSeek-V3's: with the Triton latent operator,
    below)."""
    base, loras, refs = case
    monkeypatch.setitem(selector.LAYER_KERNELS, "lora-moe-triton", lambda: TRITON)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "lora-moe-triton")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    names = ["a", "b", None]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(
        [PROMPTS[1]] * 3, params, use_tqdm=False, lora_request=[loras[n] for n in names]
    )
    assert [o.outputs[0].token_ids for o in outputs] == [refs[n][1][:3] for n in names]


@pytest.mark.parametrize("case", ["deepseek_v3"], indirect=True)
def test_triton_latent_operator_in_graph_replays_equal_peft(case, monkeypatch):
    """The Triton latent operator (its extend and decode kernels, interpreted) with the
    shrink/expand kernels absorbing kv_b_proj's updates, decode steps as their graphs replay
    them (emulated on the CPU: one token-slot buffer, whatever the adapters): two adapters and
    the base model in one batch."""
    base, loras, refs = case
    monkeypatch.setitem(selector.LAYER_KERNELS, "lora-moe-triton", lambda: TRITON)
    monkeypatch.setattr(CpuPlatform, "layer_kernels", lambda self: "lora-moe-triton")
    llm = LLM(
        str(base), attention_backend="triton", max_model_len=64, enable_lora=True, max_loras=2,
        max_lora_rank=8,
    )  # fmt: skip
    graphs = replay_views(llm, max_batch=4)
    names = ["a", "b", None]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = lora_tokens(llm, [PROMPTS[1]] * 3, params, [loras[n] for n in names])
    assert got == [refs[n][1][:3] for n in names]
    assert (3, 1) in graphs.replayed


@pytest.mark.gpu
def test_cuda_graphs_serve_any_mix_of_adapters(case):
    """fp32 on CUDA: decode graphs captured once (the fused experts with their LoRA addends)
    replay steps of two adapters and the base model; outputs equal PEFT's."""
    base, loras, refs = case
    llm = cuda_graph_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    for names in (["a", "b", None], [None, "a", "b"]):
        want = [refs[n][i] for i, n in enumerate(names)]
        assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want


def test_adapters_that_do_not_fit_are_refused_by_name(case, tmp_path):
    """An experts' pair of another model's shapes, a kv_b_proj pair of another model's (of
    other heads than DeepSeek's; Qwen has no such layer) and a rank_pattern giving a stack a
    rank above max_lora_rank are each refused naming the adapter and what does not fit; the
    other prompt runs."""
    base, loras, refs = case
    src = loras["a"].lora_path
    key = next(k for k in peft.load_peft_weights(src) if k.endswith("experts.lora_B.weight"))
    kv_b = key.replace("mlp.experts", "self_attn.kv_b_proj")

    def on_kv_b(t):
        t[kv_b.replace("lora_B", "lora_A")], t[kv_b] = torch.zeros(8, 32), torch.zeros(16, 8)

    wrong = [
        ("shape", {}, lambda t: t.update({key: t[key][:-1]})),
        ("kv_b", {}, on_kv_b),
        ("pattern", {"rank_pattern": {r".*\.gate_up_proj": 16}}, id),
    ]
    requests = [
        LoRARequest(name, i, edited_adapter_copy(src, tmp_path / name, config, edit))
        for i, (name, config, edit) in enumerate(wrong, 3)
    ]
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_lora_rank=8)
    prompts = [PROMPTS[1]] * 4
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[*requests, loras["a"]])
    errors = [o.error for o in outputs[:3]]
    assert "'shape'" in errors[0] and "mlp.experts" in errors[0] and "do not fit" in errors[0]
    assert "'kv_b'" in errors[1] and "kv_b_proj" in errors[1]
    assert "'pattern'" in errors[2] and "r=16 is above max_lora_rank=8" in errors[2]
    assert "experts.gate_up_proj" in errors[2]
    assert outputs[3].error is None and outputs[3].outputs[0].token_ids == refs["a"][1]


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"], indirect=True)
def test_two_ranks_serve_adapters_mixed_in_one_batch(case):
    """Tensor parallelism: each rank holds its intermediate features of every expert's pair
    (rows of the gate/up B, columns of the down A), the down updates summed with the experts'
    outputs; and its heads' rows of kv_b_proj's B (all of A)."""
    base, loras, refs = case
    names = ["a", "b", None]
    want = [refs[n][i] for i, n in enumerate(names)]
    with LLM(
        str(base), max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8,
        tensor_parallel_size=2,
    ) as llm:  # fmt: skip
        assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want


def test_qwen3_5_moe_adapter_and_base_mixed_equal_peft(tmp_path):
    """Qwen3.5-MoE (gated-delta layers around gated attention, every MLP a sparse block with
    a gated shared expert): an adapter on the attention (whose packed projection's rows are
    reordered after loading; B's rows follow) and both expert stacks beside the base model in
    one batch."""
    config = tf.Qwen3_5MoeTextConfig(
        **QWEN3_5 | dict(num_hidden_layers=2, layer_types=QWEN3_5["layer_types"][:2]),
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, tie_word_embeddings=False,
    )  # fmt: skip
    base = save_random_model(config, tmp_path / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = save_random_adapter(base, tmp_path / "a", 1, 8, targets, target_parameters=EXPERTS)
    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    want = [
        peft_greedy(base, adapter, PROMPTS[:1], MAX_NEW)[0],
        hf_greedy(hf, PROMPTS[1:2], MAX_NEW)[0],
    ]
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_lora_rank=8)
    request = LoRARequest("a", 1, str(adapter))
    assert lora_tokens(llm, PROMPTS[:2], GREEDY, [request, None]) == want


@pytest.mark.parametrize("case", ["qwen3_moe"], indirect=True)
def test_peft_rewrite_of_gate_up_down_targets_equals_peft(case, tmp_path):
    """Targeting gate/up/down_proj of a MoE model, PEFT writes the experts' stacks, gate and
    up fused at twice the rank (a rank_pattern and alpha_pattern on gate_up_proj): served
    beside the base model, equal to PEFT's."""
    base, _, refs = case
    targets = ["q_proj", *MLP]  # (the attention's kept as written)
    adapter = save_random_adapter(base, tmp_path / "fused", 3, 4, targets, lora_alpha=8)
    assert json.loads((adapter / "adapter_config.json").read_text())["rank_pattern"]
    want = peft_greedy(base, adapter, PROMPTS[:1], MAX_NEW) + refs[None][1:2]
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_lora_rank=8)
    request = LoRARequest("fused", 1, str(adapter))
    assert lora_tokens(llm, PROMPTS[:2], GREEDY, [request, None]) == want
    assert want[0] != refs[None][0]


@pytest.mark.parametrize("case", ["deepseek_v3"], indirect=True)
def test_more_adapters_than_slots_chunked_and_preempted(case):
    """One slot for two adapters, prompts prefilled in chunks of 8 tokens, a KV pool small
    enough that requests are preempted (and recomputed under their adapters)."""
    base, loras, refs = case
    names = ["b", "a", None]
    llm = LLM(
        str(base), max_model_len=32, enable_lora=True, max_loras=1, max_lora_rank=8,
        max_num_batched_tokens=8, num_kv_blocks=3,
    )  # fmt: skip
    want = [refs[n][i] for i, n in enumerate(names)]
    assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("case", ["deepseek_v3"], indirect=True)
def test_kv_b_proj_alone_chunked_and_from_the_prefix_cache(case, tmp_path):
    """An adapter on kv_b_proj alone (rsLoRA) beside another adapter and the base model, in
    one batch: prompts prefilled in chunks of 8 tokens (each chunk decompresses the latents
    cached before it), then decoded from the cached latents; run again, the prompts' full
    blocks come from the prefix cache."""
    base, loras, refs = case
    path = save_random_adapter(
        base, tmp_path / "kv_b", 3, 4, ["kv_b_proj"], lora_alpha=8, use_rslora=True
    )
    refs = refs | {"kv_b": peft_greedy(base, path, PROMPTS, MAX_NEW)}
    assert refs["kv_b"] != refs[None]
    loras = loras | {"kv_b": LoRARequest("kv_b", 3, str(path))}
    llm = LLM(
        str(base), max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8,
        max_num_batched_tokens=8, block_size=4,
    )  # fmt: skip
    for names in (["kv_b", "a", None], ["kv_b", "kv_b", "a"]):
        want = [refs[n][i] for i, n in enumerate(names)]
        hits = llm.engine.kv_cache.prefix_cache_hits
        assert lora_tokens(llm, PROMPTS, GREEDY, [loras[n] for n in names]) == want
    assert llm.engine.kv_cache.prefix_cache_hits > hits
