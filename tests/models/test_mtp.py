"""Multi-token-prediction heads (DeepSeek-V3's extra layer, Qwen3.5's ``mtp.*``) on tiny random
checkpoints written with MTP weights.

HF drops those weights when it loads the model, so the reference head is composed here from
HF's own modules: its ``MtpLayer`` (norms of the embedding and of the hidden state, their
projection, the family's decoder layer, the output norm) holding the family's
``DecoderLayer`` and ``RMSNorm``, over the HF target's embedding, rotary table and LM head.
The decoder block's weights come from an HF model one layer deeper (its last layer, saved in
HF's own checkpoint format); the stored copies of DeepSeek's embedding and head are random, so
a head that used them would part from the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from execution.view_replay import replay_views
from safetensors.torch import load_file, save_file
from test_deepseek import randomize as randomize_deepseek
from test_deepseek import v3_config
from test_qwen3_5 import moe_variant, qwen3_5_config
from test_qwen3_5 import randomize as randomize_qwen3_5
from test_speculative_parity import (
    GREEDY,
    OPTIONS,
    PROMPTS,
    assert_equal_up_to_exact_ties,
    check_runner_tables,
    generate_checked,
)
from transformers.modeling_layers import MtpLayer

from heron import LLM
from heron.execution.step_plan import NewRequest, StepPlan, TableUpdate
from heron.sampling_params import SamplingParams
from heron.speculative.mtp import load_mtp_runner

from tiny_models import first_divergence_is_a_near_tie, greedy_tokens, make_tokenizer

SPECULATION = {"method": "mtp", "num_speculative_tokens": 2}


def _hf_model(family: str, extra_layers: int = 0) -> torch.nn.Module:
    if family == "deepseek_v3":
        config = v3_config()
        config.num_hidden_layers += extra_layers
        model = tf.DeepseekV3ForCausalLM(config)
        randomize_deepseek(model)
    elif family == "qwen3_5":
        config = qwen3_5_config()
        config.layer_types = [*config.layer_types, *["full_attention"] * extra_layers]
        config.num_hidden_layers += extra_layers
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_qwen3_5(model)
    else:  # Qwen3-Next, every MLP sparse (the head's too)
        config = moe_variant(tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, seed=3).config
        config.layer_types = [*config.layer_types, *["full_attention"] * extra_layers]
        config.num_hidden_layers += extra_layers
        model = tf.Qwen3NextForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
    return model.eval()


def _saved_tensors(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return load_file(path / "model.safetensors")


def _damp_layer_outputs(model: torch.nn.Module) -> None:
    """Scale every layer's output projections down: the residual stream stays close to the
    token's embedding, so the next token depends mostly on the current one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("o_proj", "down_proj", "out_proj")):
                p.mul_(0.3)


def _make_predictive(reference: MtpLayer, target: torch.nn.Module) -> None:
    """A head that passes the next token's embedding through (``eh_proj`` ~ ``[I | 0]``,
    neutral input norms, the target's final norm as its own): over a target whose next token
    depends mostly on the current one it predicts the token after next, mostly."""
    hidden = reference.eh_proj.weight.shape[0]
    with torch.no_grad():
        reference.eh_proj.weight.normal_(0.0, 0.01)
        reference.eh_proj.weight[:, :hidden] += torch.eye(hidden)
        for norm in (reference.enorm, reference.hnorm):
            norm.weight.fill_(1.0 - norm_offset(target))
        reference.post_norm.weight.copy_(target.model.norm.weight)


def norm_offset(target: torch.nn.Module) -> float:
    """1 for the ``(1 + w)`` norms of Qwen3.5 and Qwen3-Next, whose neutral weight is 0."""
    return 1.0 if isinstance(target, (tf.Qwen3_5ForCausalLM, tf.Qwen3NextForCausalLM)) else 0.0


def save_with_mtp(
    family: str, path: Path, predictive: bool = False
) -> tuple[torch.nn.Module, MtpLayer]:
    """The HF target saved to ``path`` with an MTP layer under the family's names, and the HF
    reference of that layer; ``predictive``: a target whose next token depends mostly on the
    current one and a head made to exploit it (so proposals are accepted, and some refused)."""
    torch.manual_seed(0)
    target = _hf_model(family)
    n = target.config.num_hidden_layers
    deeper = _hf_model(family, extra_layers=1)
    if predictive:
        _damp_layer_outputs(target)
        _damp_layer_outputs(deeper)
    block = _saved_tensors(deeper, path / "deeper")
    tensors = _saved_tensors(target, path)
    make_tokenizer().save_pretrained(path)
    config = target.config
    # the family's own decoder layer and norm classes, as HF's MtpModel takes them
    layer_cls = type(deeper.model.layers[n])
    norm_cls = type(deeper.model.norm)
    reference = MtpLayer(deeper.config, layer_cls, norm_cls, n).eval()
    reference.mtp_block = deeper.model.layers[n]
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if not name.startswith("mtp_block."):
                p.normal_(0.0, 0.1) if p.dim() == 2 else p.uniform_(0.8, 1.2)
    if predictive:
        _make_predictive(reference, target)
    own = {k: v for k, v in reference.state_dict().items() if not k.startswith("mtp_block.")}
    prefix = f"model.layers.{n}."
    block = {k.removeprefix(prefix): v for k, v in block.items() if k.startswith(prefix)}
    if family == "deepseek_v3":
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj"}
        names["post_norm"] = "shared_head.norm"
        mtp = {f"{prefix}{names[k.split('.')[0]]}.weight": v for k, v in own.items()}
        mtp |= {prefix + k: v for k, v in block.items()}
        vocab = (config.vocab_size, config.hidden_size)
        mtp[prefix + "embed_tokens.weight"] = torch.randn(vocab)  # not the head's: the
        mtp[prefix + "shared_head.head.weight"] = torch.randn(vocab)  # target's are shared
        field = "num_nextn_predict_layers"
    else:
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}
        names["post_norm"] = "norm"
        mtp = {f"mtp.{names[k.split('.')[0]]}.weight": v for k, v in own.items()}
        mtp |= {"mtp.layers.0." + k: v for k, v in block.items()}
        field = "mtp_num_hidden_layers"
    save_file(tensors | mtp, path / "model.safetensors", metadata={"format": "pt"})
    config_file = path / "config.json"
    config_json = json.loads(config_file.read_text())
    config_json[field] = 1
    config_file.write_text(json.dumps(config_json))
    return target, reference


def hf_mtp(target, reference: MtpLayer, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The reference head over a whole sequence: row ``p`` pairs ``tokens[p]`` (the token at
    ``p + 1``) with ``hidden[p]``, causally."""
    length = len(tokens)
    positions = torch.arange(length)[None]
    embeds = target.model.embed_tokens(torch.tensor([tokens]))
    rotary_positions = positions
    if isinstance(target, tf.Qwen3_5ForCausalLM):  # (its rotary table takes 3 rows of ids)
        rotary_positions = positions[None].expand(3, 1, -1)
    rotary = target.model.rotary_emb(embeds, rotary_positions)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = reference(embeds, hidden[None], rotary, mask, positions, None)
    return out[0]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "qwen3_next"])
def test_head_equals_hf_composition(family, tmp_path):
    """The head's prefill over a prompt (from HF's target hidden states), then one drafted
    position fed its own output: both equal the reference, and so do the target's hidden
    states the runner hands out."""
    target, reference = save_with_mtp(family, tmp_path)
    prompt = [(i * 37) % 300 + 5 for i in range(14)]
    with torch.no_grad():
        hidden = target.model(torch.tensor([prompt])).last_hidden_state[0]
    options = dict(max_model_len=64, num_kv_blocks=32, block_size=4)
    llm = LLM(str(tmp_path), **options, enable_prefix_caching=False)
    runner = llm.engine.runner

    # the target's hidden states, kept only when asked for
    launch, kept = runner.launch, []
    runner.launch = lambda *args: kept.append(launch(*args)) or kept[-1]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert kept[0].hidden_states is None
    runner.keep_hidden_states = True
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    torch.testing.assert_close(kept[-1].hidden_states, hidden, atol=1e-4, rtol=1e-4)

    head = load_mtp_runner(runner, "reference", 32)
    head.allocate_kv_cache([16])
    shifted = prompt[1:]
    new = NewRequest("r", shifted, len(shifted), SamplingParams(temperature=0.0), None)
    plan = StepPlan(
        request_ids=["r"],
        num_computed=[0],
        num_new=[len(shifted)],
        samples=[True],
        new_requests=[new],
        table_updates=[TableUpdate("r", 0, 0, list(range(1, 6)))],
    )
    head.model.stage_hidden(hidden[:-1])
    step = head.launch(plan)
    want = hf_mtp(target, reference, shifted, hidden[:-1])
    torch.testing.assert_close(step.hidden_states, want, atol=1e-4, rtol=1e-4)
    (draft,) = step.result().token_ids
    assert draft == target.lm_head(want[-1]).argmax().item()

    head.model.stage_hidden(step.hidden_states[-1:])
    step = head.launch(StepPlan(["r"], [len(shifted)], [1], [True]))
    want = hf_mtp(target, reference, [*shifted, draft], torch.cat([hidden[:-1], want[-1:]]))
    torch.testing.assert_close(step.hidden_states, want[-1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_greedy_with_mtp_equals_greedy_without(family, tmp_path, monkeypatch):
    """Chunked prefill, preemption and prefix hits (the prompts share one), as the n-gram
    parity test; the head's own pool and prefix cache beside the target's."""
    save_with_mtp(family, tmp_path, predictive=True)
    path = str(tmp_path)
    options = dict(OPTIONS, num_kv_blocks=40)
    plain = LLM(path, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(path, **options, speculative_config=SPECULATION)
    check_runner_tables(llm, monkeypatch)
    assert_equal_up_to_exact_ties(path, generate_checked(llm, PROMPTS, GREEDY), want)
    engine, stats = llm.engine, llm.engine.spec_decode_stats
    assert engine.kv_cache.prefix_cache_hits > 0
    assert engine.scheduler.num_preemptions > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def spy_head_steps(llm: LLM) -> list[tuple[StepPlan, int | None]]:
    """From now on, each of the MTP head's steps: its plan, and the query length of the graph
    it replayed (None: it ran eagerly)."""
    head = llm.engine.draft_runner
    steps, replayed = [], []
    run, launch = head.graphs.run, head.launch
    head.graphs.run = lambda seq: replayed.append(seq.max_query_len) or run(seq)

    def counted(plan, *args):
        before = len(replayed)
        step = launch(plan, *args)
        steps.append((plan, replayed[-1] if len(replayed) > before else None))
        return step

    head.launch = counted
    return steps


def assert_steady_state_replays(steps: list[tuple[StepPlan, int | None]], num_requests: int):
    """Every head step replayed a graph but a request's first catch-up (over its prompt), and
    the uniform catch-ups replayed those of ``1 + k`` tokens a row; returns how many ran."""
    seen, eager, catch_ups = set(), 0, 0
    for plan, query_len in steps:
        first_pass = not seen.issuperset(plan.request_ids)
        seen.update(plan.request_ids)
        if plan.device_inputs:
            catch_ups += 1
            assert query_len == 1 + SPECULATION["num_speculative_tokens"], plan
        elif query_len is None:
            eager += 1
            assert first_pass, plan
    assert eager <= num_requests
    return catch_ups


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_steady_state_head_steps_replay_graphs(family, tmp_path):
    """Graphs as they replay (emulated on the CPU, ``execution.view_replay``) on the Triton
    operators: after a request's first pass, its head catches up on each verification in one
    uniform step of ``1 + k`` positions a row, and every head step of those passes (catch-up
    and decode steps) replays a graph; greedy output is plain decoding's, and both pools get
    every block back."""
    save_with_mtp(family, tmp_path, predictive=True)
    path = str(tmp_path)
    options = dict(attention_backend="triton", max_model_len=96, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[2:4]
    want = greedy_tokens(LLM(path, **options), prompts, params)
    llm = LLM(path, **options, speculative_config=SPECULATION)
    replay_views(llm)
    steps = spy_head_steps(llm)
    assert_equal_up_to_exact_ties(path, greedy_tokens(llm, prompts, params), want)
    assert assert_steady_state_replays(steps, len(prompts)) >= 2
    stats = llm.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for kv in (llm.engine.kv_cache, llm.engine.proposer.kv_cache):
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks - 1


def test_eager_catch_ups_where_the_uniform_one_does_not_fit(tmp_path, monkeypatch):
    """A 4-token budget: one uniform catch-up of ``1 + k`` fits a step, another row with
    tokens to catch up does so eagerly, and a request proposed for but not scheduled (the
    budget spent) computes its last position again. Greedy output is plain decoding's (up to
    exact ties), and both pools get every block back."""
    save_with_mtp("qwen3_5", tmp_path, predictive=True)
    path = str(tmp_path)
    options = dict(max_model_len=96, block_size=4, max_num_batched_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[3], [7], [11]]  # (all three prefilled in the first step)
    want = greedy_tokens(LLM(path, **options), prompts, params)
    llm = LLM(path, **options, speculative_config=SPECULATION)
    proposer, behind = llm.engine.proposer, []  # (uniform, head tokens not computed)
    sync = proposer._sync

    def counted(seq, ingests):
        behind.append((ingests, len(seq.request_tokens) - 1 - seq.num_computed_tokens))
        sync(seq, ingests)

    monkeypatch.setattr(proposer, "_sync", counted)
    assert_equal_up_to_exact_ties(path, greedy_tokens(llm, prompts, params), want)
    assert (True, 1) in behind and (True, 3) in behind  # refused proposals, accepted ones
    assert (False, 1) in behind  # past the budget
    assert (False, 0) in behind  # not scheduled since its last pass
    assert all(0 <= n <= 1 + SPECULATION["num_speculative_tokens"] for _, n in behind)
    assert llm.spec_decode_stats.num_accepted_tokens > 0
    for kv in (llm.engine.kv_cache, llm.engine.proposer.kv_cache):
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks - 1


def test_fp8_head_keeps_eh_proj_in_full_precision(tmp_path):
    """Under an FP8 scheme DeepSeek's head quantises its layer's projections, not ``eh_proj``
    (unquantised in DeepSeek-V3's FP8 checkpoints)."""
    save_with_mtp("deepseek_v3", tmp_path)
    options = dict(quantization="fp8", max_model_len=64, num_kv_blocks=16)
    llm = LLM(str(tmp_path), **options, speculative_config=SPECULATION)
    head = llm.engine.proposer.head
    enorm, hnorm, eh_proj, layer, _ = head.parts
    assert eh_proj.weight_scale is None and eh_proj.weight.dtype == torch.float32
    assert layer.self_attn.o_proj.weight_scale is not None


def test_checkpoint_without_mtp_is_refused(tmp_path, tiny_model_dir):
    """A family without MTP heads, a config without MTP layers, and a config that names one
    the checkpoint does not hold: each a clear error."""
    with pytest.raises(ValueError, match="'mtp' is not supported for LlamaForCausalLM"):
        LLM(str(tiny_model_dir("llama")), speculative_config=SPECULATION)
    torch.manual_seed(0)
    target = _hf_model("deepseek_v3")
    _saved_tensors(target, tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'mtp': .* no multi-token.*num_nextn_predict_layers = 0"):
        LLM(str(tmp_path), speculative_config=SPECULATION)
    config_file = tmp_path / "config.json"
    config_json = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config_json | {"num_nextn_predict_layers": 1}))
    with pytest.raises(
        ValueError, match="'mtp': checkpoint is missing weights for: model.layers.2"
    ):
        LLM(str(tmp_path), speculative_config=SPECULATION)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_bf16_with_graphs_on_cuda_follows_plain_decoding(family, tmp_path):
    """bf16 on the GPU, the head's steps replayed from its own graphs (all but each request's
    first catch-up): where a request's tokens first leave plain greedy decoding's, both tokens
    are in HF's fp32 top-5 there (DESIGN's near-tie rule); prints how many outputs are
    identical."""
    target, _ = save_with_mtp(family, tmp_path, predictive=True)
    path = str(tmp_path)
    options = dict(device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    want = greedy_tokens(LLM(path, cuda_graph_max_bs=8, **options), PROMPTS, GREEDY)
    llm = LLM(path, cuda_graph_max_bs=8, speculative_config=SPECULATION, **options)
    assert llm.engine.draft_runner.graphs is not None
    steps = spy_head_steps(llm)
    got = greedy_tokens(llm, PROMPTS, GREEDY)
    assert assert_steady_state_replays(steps, len(PROMPTS)) > 0
    identical = sum(a == b for a, b in zip(got, want))
    stats = llm.engine.spec_decode_stats
    print(f"{family}: {identical}/{len(PROMPTS)} identical, {stats}")
    assert stats.num_accepted_tokens > 0, stats
    for prompt, a, b in zip(PROMPTS, got, want):
        assert first_divergence_is_a_near_tie(target, prompt, a, b), (prompt, a, b)
