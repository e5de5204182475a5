"""Speculation through the engine: sampled rows reproducible by seed, stops inside an accepted
run, limits, the batch-size switch, and the counters /metrics reports."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
import torch
import transformers as tf
from prometheus_client.parser import text_string_to_metric_families

from heron import LLM, SamplingParams, StructuredOutputsParams
from heron.config import EngineConfig
from heron.engine.messages import CoreArgs, EngineStats, FrontEndpoints
from heron.server.metrics import ServerMetrics

SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# The last ends in the tiny llama's own greedy continuation of its start, which repeats: the
# proposals it finds are often its likely tokens.
PROMPTS = [
    [5, 6, 7, 8, 9] * 4,
    [3, 4, 3, 4, 3, 4, 3],
    list(range(10, 40)),
    [5, 6, 7, 8, 9] * 4 + [84, 58, 84, 84, 84, 300, 84, 84],
]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def speculation(method: str, llama: str) -> dict:
    """n-gram proposals, or the target itself as the draft model (its proposals are its
    greedy tokens: each is accepted with its probability when sampling)."""
    if method == "ngram":
        return SPECULATION
    return {"method": method, "model": llama, "num_speculative_tokens": 4}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_with_speculation_is_reproducible_by_seed(method, llama):
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=24, seed=3, n=2)
    llms = [LLM(llama, speculative_config=speculation(method, llama)) for _ in range(2)]
    runs = [tokens(llm, params) for llm in llms]
    assert runs[0] == runs[1]
    assert any(a != b for a, b in runs[0])  # the two samples of a prompt draw differently
    assert llms[0].spec_decode_stats.num_accepted_tokens > 0  # sampled rows verified some


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_sequences_follow_the_target_distribution(method, llama):
    """Three tokens sampled at temperature 0.5 among the top 3, with proposals verified at the
    second and third: a chi-square of the 27 sequences' counts against HF's probabilities."""
    temperature, top_k, n = 0.5, 3, 2000
    hf = tf.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()

    def top(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([prefix])).logits[0, -1] / temperature
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    prompt = PROMPTS[-1]
    want = {}
    for a, pa in top(prompt).items():
        for b, pb in top(prompt + [a]).items():
            for c, pc in top(prompt + [a, b]).items():
                want[a, b, c] = pa * pb * pc
    # Every row proposes, however many run at once.
    spec = speculation(method, llama) | {"disable_by_batch_size": None}
    llm = LLM(llama, speculative_config=spec)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outputs)
    assert set(counts) <= set(want)
    stat = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in want.items())
    p_value = torch.special.gammaincc(torch.tensor((len(want) - 1) / 2), torch.tensor(stat / 2))
    spec = llm.spec_decode_stats
    print(
        f"chi-square {stat:.1f} (p = {p_value:.3f}); accepted {spec.num_accepted_tokens} of "
        f"{spec.num_draft_tokens} proposals"
    )
    assert p_value > 1e-3
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_a_stop_inside_an_accepted_run_ends_there(llama):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = tokens(LLM(llama), greedy)
    llm = LLM(llama, speculative_config=SPECULATION)
    for prompt, (want,) in zip(PROMPTS, plain):
        stop = want[12]  # a token late enough to come inside a verified run
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
        (got,) = tokens(llm, params, [prompt])[0]
        assert got == want[: want.index(stop) + 1]
    for max_tokens in (1, 5, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert tokens(llm, params) == [[w[:max_tokens]] for (w,) in plain]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks - 1


def test_uniform_steps_keep_their_query_length_to_max_tokens(llama, monkeypatch):
    """With uniform proposals (verification graphs) a request's last steps are padded to ``k``
    past ``max_tokens`` too, so they keep the graphs' query length; the tokens past it are
    dropped and every block comes back."""
    k = SPECULATION["num_speculative_tokens"]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = tokens(LLM(llama), greedy)
    llm = LLM(llama, speculative_config=SPECULATION)
    runner = llm.engine.runner
    monkeypatch.setattr(llm.engine.speculator, "uniform_up_to", 8)
    query_lens = set()
    launch = runner.launch

    def recorded(plan, previous=None, drafts=None):
        if plan.draft_token_ids:
            query_lens.update(plan.num_new)
        return launch(plan, previous, drafts)

    monkeypatch.setattr(runner, "launch", recorded)
    for max_tokens in (2, 5, 7, 11):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for prompt, (want,) in zip(PROMPTS, plain):
            assert tokens(llm, params, [prompt]) == [[want[:max_tokens]]]
    assert query_lens == {1 + k}
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks - 1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_above_the_batch_size_limit_steps_are_plain_and_asynchronous(method, llama, monkeypatch):
    """While more requests run than ``disable_by_batch_size``, nothing is proposed and steps
    stay in flight; once fewer run, proposals resume (a draft model first catches up on the
    tokens decoded meanwhile): the tokens are plain greedy's."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 8, 8, 30)]
    plain = LLM(llama).generate(PROMPTS, params, use_tqdm=False)
    spec = speculation(method, llama) | {"disable_by_batch_size": 1}
    llm = LLM(llama, speculative_config=spec)
    engine, in_flight = llm.engine, []
    step = engine.step

    def recorded():
        outputs = step()
        in_flight.append(engine._in_flight)
        return outputs

    monkeypatch.setattr(engine, "step", recorded)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert any(f is not None for f in in_flight)  # asynchronous while four ran
    assert llm.spec_decode_stats.num_accepted_tokens > 0  # speculation once one was left


def test_metrics_report_proposed_and_accepted_tokens(llama):
    llm = LLM(llama, speculative_config=SPECULATION)
    tokens(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    spec = llm.spec_decode_stats
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.mean_acceptance_length == 1 + spec.num_accepted_tokens / spec.num_drafts
    stats = msgspec.msgpack.decode(
        msgspec.msgpack.encode(EngineStats.of(llm.engine)), type=EngineStats
    )
    text = ServerMetrics(lambda: stats).render().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["heron:spec_decode_num_draft_tokens_total"] == spec.num_draft_tokens
    assert samples["heron:spec_decode_num_accepted_tokens_total"] == spec.num_accepted_tokens
    assert samples["heron:spec_decode_num_drafts_total"] == spec.num_drafts


def test_rows_without_proposals_share_the_step(llama):
    """Rows with logprobs or a grammar are sampled as usual beside verified rows, and keep what
    they get without speculation."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    others = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[ab]+")
        ),
    ]
    params = [greedy, *others, greedy]
    plain = LLM(llama).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(llama, speculative_config=SPECULATION)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(got, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for a, b in zip(got[1].outputs[0].logprobs, plain[1].outputs[0].logprobs):
        assert a.top.keys() == b.top.keys() and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert llm.spec_decode_stats.num_accepted_tokens > 0


def test_the_config_reaches_the_engine_core():
    """The server's core process gets the engine config as JSON."""
    config = EngineConfig(speculative_config=SPECULATION)
    args = CoreArgs(config, [FrontEndpoints(0, "ipc://a", "ipc://b")], "INFO")
    decoded = msgspec.json.decode(msgspec.json.encode(args), type=CoreArgs)
    assert decoded.config.speculative == config.speculative
