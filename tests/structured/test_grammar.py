"""Structured outputs in the engine: specs, the device mask against a dense reference, grammar
compilation off the step loop, and constrained sampling of a tiny random model."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from heron import LLM, SamplingParams
from heron.engine.request import Request
from heron.structured import ReasoningTokens, StructuredOutputsParams
from heron.structured.bitmask import apply_token_bitmask
from heron.structured.grammar import GrammarCompiler, RequestGrammar, parse_grammar

from json_schemas import SCHEMAS
from tiny_models import make_tokenizer, tiny_config


def _dense_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Bit ``j % 32`` of word ``j // 32`` of each row allows token ``j``; the rest is -inf."""
    vocab = logits.shape[-1]
    j = torch.arange(vocab)
    words = bitmask[:, (j // 32).clamp(max=bitmask.shape[-1] - 1)].long()
    allowed = ((words >> (j % 32)) & 1).bool() & (j < bitmask.shape[-1] * 32)
    return torch.where(allowed, logits, torch.full_like(logits, float("-inf")))


@pytest.mark.parametrize("vocab,mask_vocab", [(320, 320), (100, 100), (352, 320)])
def test_mask_matches_dense_reference(vocab, mask_vocab):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    words = -(-mask_vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int32)
    bitmask[2] = -1  # a row without a grammar allows everything (up to the mask's width)
    expected = _dense_reference(logits, bitmask)
    apply_token_bitmask(logits, bitmask)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_mask_on_cuda_matches_dense_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 1000, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (7, 32), generator=gen, dtype=torch.int32)
    on_device = logits.cuda()
    apply_token_bitmask(on_device, bitmask)
    torch.testing.assert_close(on_device.cpu(), _dense_reference(logits, bitmask), rtol=0, atol=0)


def test_params_take_exactly_one_valid_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of.*regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{bad")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json='{"type": "object"}').key == (
        StructuredOutputsParams(json={"type": "object"}).key
    )
    with pytest.raises(ValueError, match="min_tokens or ignore_eos"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


@pytest.mark.parametrize(
    "params,field",
    [
        (StructuredOutputsParams(regex="(ab"), "regex"),
        (StructuredOutputsParams(grammar="root ::= missing"), "grammar"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is invalid"):
        parse_grammar(params)


def test_compiled_grammars_are_cached_and_padded_ids_masked():
    compiler = GrammarCompiler(make_tokenizer(), vocab_size=352, stop_token_ids=[0])
    params = StructuredOutputsParams(choice=["red", "green"])
    first = compiler.compile(params)
    assert compiler.compile(StructuredOutputsParams(choice=["red", "green"])) is first
    grammar = RequestGrammar(first, compiler.stop_token_ids)
    first.result(timeout=30)
    mask = compiler.token_bitmask([grammar, None])
    allowed = _dense_reference(torch.zeros(2, 352), mask).isfinite()
    assert allowed[1].all()  # no grammar: every id
    assert allowed[0].any() and not allowed[0, 320:].any()  # ids past the tokenizer: never


@pytest.mark.parametrize("opens", [True, False], ids=["opened", "not-opened"])
def test_grammar_starts_after_the_reasoning(opens):
    """Qwen3's phases (ids past the tokenizer stand for <think>, </think>): the first token may
    open the block beside the grammar's own, the block is free, the grammar follows its end."""
    start, end = 330, 331
    compiler = GrammarCompiler(make_tokenizer(), vocab_size=352, stop_token_ids=[0])
    params = StructuredOutputsParams(
        choice=["red", "green"], reasoning=ReasoningTokens(end=end, start=start)
    )
    grammar = compiler.request_grammars(params, 1)[0]
    plain = RequestGrammar(compiler.compile(StructuredOutputsParams(choice=["red", "green"])), [0])
    plain.compiled.result(timeout=30)

    def allowed(g: RequestGrammar) -> torch.Tensor:
        return _dense_reference(torch.zeros(1, 352), compiler.token_bitmask([g])).isfinite()[0]

    first = allowed(grammar)
    expected = allowed(plain)
    expected[start] = True
    assert torch.equal(first, expected)
    if not opens:
        token = int(allowed(plain).nonzero()[0])
        assert grammar.accept(token) and plain.accept(token)
        assert torch.equal(allowed(grammar), allowed(plain))
        return
    assert grammar.accept(start)
    for token in (5, 300, start):  # anything goes while reasoning
        assert allowed(grammar).all() and grammar.accept(token)
    assert grammar.accept(end)
    assert torch.equal(allowed(grammar), allowed(plain))  # the grammar from its start
    assert not grammar.accept(end)


def test_requests_wait_for_their_grammar_without_blocking_others(tiny_model_dir):
    engine = LLM(str(tiny_model_dir("qwen2")), max_model_len=128, num_kv_blocks=64).engine
    pending: Future = Future()
    waiting = Request("w", [1, 2, 3], SamplingParams(max_tokens=2))
    waiting.grammar = RequestGrammar(pending, [0])
    engine.scheduler.add(waiting)
    engine.scheduler.add(Request("plain", [4, 5, 6], SamplingParams(max_tokens=2)))
    scheduled = [s.request.request_id for s in engine.scheduler.schedule().scheduled]
    assert scheduled == ["plain"] and list(engine.scheduler.waiting) == [waiting]
    pending.set_result(None)
    assert "w" in [s.request.request_id for s in engine.scheduler.schedule().scheduled]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen2")), max_model_len=256, num_kv_blocks=200)


def test_sampled_json_validates_against_its_schema(llm):
    """(The server's test samples 50 completions; this one checks the offline path.)"""
    schema = SCHEMAS[0]
    params = SamplingParams(
        n=4,
        temperature=1.0,
        max_tokens=96,
        seed=3,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    (output,) = llm.generate(["Describe a user:"], params, use_tqdm=False)
    assert len(output.outputs) == 4
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), schema)


def test_json_object_grammar_takes_objects_only():
    compiler = GrammarCompiler(make_tokenizer(), vocab_size=320, stop_token_ids=[0])
    compiled = compiler.compile(StructuredOutputsParams(json_object=True))
    assert RequestGrammar(compiled, [0]).matcher.accept_string('{"a": [1, {"b": null}]}')
    assert not RequestGrammar(compiled, [0]).matcher.accept_string("[1]")


def test_string_length_bounds_hold_in_the_grammar():
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["name"],
    }
    compiler = GrammarCompiler(make_tokenizer(), vocab_size=320, stop_token_ids=[0])
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    for name, ok in [("a", False), ("ab", True), ("abcd", True), ("abcde", False)]:
        accepted = RequestGrammar(compiled, [0]).matcher.accept_string(f'{{"name": "{name}"}}')
        assert accepted == ok, name


def test_regex_and_choice_mixed_with_free_rows(llm):
    """Constrained and free requests share steps (with asynchronous scheduling on)."""
    regex = StructuredOutputsParams(regex=r"[a-c]{2}-\d{3}")
    choice = StructuredOutputsParams(choice=["yes", "no", "it depends"])
    params = [
        SamplingParams(n=4, temperature=1.0, max_tokens=16, structured_outputs=regex),
        SamplingParams(n=4, temperature=1.0, max_tokens=16, structured_outputs=choice),
        SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True),
    ]
    outputs = llm.generate(["regex:", "choice:", "free text"], params, use_tqdm=False)
    regex_texts, choices = ([s.text for s in o.outputs] for o in outputs[:2])
    assert all(re.fullmatch(r"[a-c]{2}-\d{3}", t) for t in regex_texts), regex_texts
    assert all(t in ("yes", "no", "it depends") for t in choices), choices
    assert all(len(s.token_ids) == 8 for s in outputs[2].outputs)


def test_grammar_steps_launch_once_the_previous_step_is_read(llm, monkeypatch):
    """Asynchronous scheduling stays on: free steps take their input tokens from the step in
    flight, a step whose grammar rows have tokens on the way is launched after reading it
    (each grammar has seen its tokens before its next mask), and is itself left in flight."""
    engine = llm.engine
    launches = []  # (masked, launched with a step in flight)
    launch = engine.runner.launch
    monkeypatch.setattr(
        engine.runner,
        "launch",
        lambda plan, previous, *rest: (
            launches.append((plan.token_bitmask is not None, bool(previous)))
            or launch(plan, previous, *rest)
        ),
    )
    constraint = StructuredOutputsParams(regex="[a-z]{6}")
    llm.add_request("g", "x", SamplingParams(max_tokens=8, structured_outputs=constraint))
    llm.add_request("free", "y", SamplingParams(max_tokens=24, ignore_eos=True))
    left_in_flight = []
    texts = {}
    while llm.has_unfinished_requests():
        count = len(launches)
        texts.update((o.request_id, o.outputs[0].text) for o in llm.step() if o.finished)
        if len(launches) > count:
            left_in_flight.append(engine._in_flight is not None)
    assert re.fullmatch("[a-z]{6}", texts["g"]) and len(texts["free"]) > 0
    masked = [i for i, (m, _) in enumerate(launches) if m]
    # (the first is the prefill: its grammar has no token on the way, so nothing waits)
    assert len(masked) >= 6 and not any(launches[i][1] for i in masked[1:])
    assert all(left_in_flight[i] for i in masked)
    assert any(p for m, p in launches if not m)


def test_logit_bias_chooses_within_the_grammar(llm):
    """Greedy rows with a grammar and a bias: the bias picks among the allowed tokens and never
    lifts a forbidden one (biased more), on the device and on the host path (logprobs)."""
    first_token = {
        word: llm.tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no", "z")
    }
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=8,
            logprobs=logprobs,
            structured_outputs=choice,
            logit_bias={first_token[word]: 50.0, first_token["z"]: 100.0},
        )
        for word in ("yes", "no")
        for logprobs in (None, 1)
    ]
    outputs = llm.generate(["answer:"] * 4, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == ["yes", "yes", "no", "no"]


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm):
    engine = llm.engine
    constrained = StructuredOutputsParams(regex="a+b")
    llm.add_request("bad", "x", SamplingParams(max_tokens=4, structured_outputs=constrained))
    llm.add_request("good", "y", SamplingParams(max_tokens=4, ignore_eos=True))
    failed: Future = Future()
    failed.set_exception(MemoryError("no room for the grammar"))
    engine.samples("bad")[0].grammar.compiled = failed
    finished = {}
    while llm.has_unfinished_requests():
        finished.update((o.request_id, o) for o in llm.step() if o.finished)
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert len(finished["good"].outputs[0].token_ids) == 4


def test_padded_vocabulary_ids_are_never_sampled(tmp_path):
    """A model whose logits are wider than its tokenizer (padded embeddings): the ids past the
    tokenizer have logits but no text, and the grammar must rule them out."""
    import transformers as tf

    torch.manual_seed(0)
    config = tiny_config("qwen2")
    config.vocab_size = 384
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[320:] = 2.0  # make the padding ids the likeliest
    model.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64, num_kv_blocks=32)
    constraint = StructuredOutputsParams(regex=r"[a-f]{4}")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, structured_outputs=constraint)
    (output,) = llm.generate(["x"], params, use_tqdm=False)
    for sample in output.outputs:
        assert sample.finish_reason == "stop" and max(sample.token_ids) < 320
        assert re.fullmatch(r"[a-f]{4}", sample.text)


@pytest.mark.gpu
def test_masked_sampling_under_cuda_graphs_equals_eager(tiny_model_dir):
    """Grammar rows in decode steps that replay CUDA graphs (asynchronous scheduling on): the
    masked greedy tokens equal eager mode's, and sampled rows (n > 1) keep to the grammar."""
    path = str(tiny_model_dir("qwen3"))
    options = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=128)
    graphs = LLM(path, cuda_graph_max_bs=8, **options)
    replayed = []
    run = graphs.engine.runner.graphs.run
    graphs.engine.runner.graphs.run = lambda seq: replayed.append(seq.num_reqs) or run(seq)
    eager = LLM(path, enforce_eager=True, **options)
    regex = r"[a-c]{3}-\d{2}-[xyz]{4}"
    schema = SCHEMAS[1]

    def params(constraint, **kwargs):
        return SamplingParams(max_tokens=96, structured_outputs=constraint, **kwargs)

    requests = [
        params(StructuredOutputsParams(regex=regex), temperature=0),
        params(StructuredOutputsParams(json=schema), temperature=0),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        params(StructuredOutputsParams(regex=regex), n=4, temperature=1.0, seed=9),
    ]
    prompts = ["a", "b", "c", "d"]
    with_graphs = graphs.generate(prompts, requests, use_tqdm=False)
    assert replayed  # decode steps with grammar rows replayed graphs
    without = eager.generate(prompts[:3], requests[:3], use_tqdm=False)
    for a, b in zip(with_graphs[:3], without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert re.fullmatch(regex, with_graphs[0].outputs[0].text)
    jsonschema.validate(json.loads(with_graphs[1].outputs[0].text), schema)
    assert all(re.fullmatch(regex, s.text) for s in with_graphs[3].outputs)
