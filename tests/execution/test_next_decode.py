"""Decode steps chained on the device (``ModelRunner.chain_decode_steps``): the metadata a
chained step derives from the step before it is the one the host would pack for it, across a
block boundary too, and the tokens equal those of the same steps each prepared on the host;
anything else (a plan that changes tables, an intervening launch, a table without the next
token's block, a sliding window) is prepared on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron import LLM
from heron.execution.model_runner import ModelRunner
from heron.execution.step_plan import NewRequest, StepPlan, TableUpdate
from heron.sampling_params import SamplingParams

BLOCK = 16  # (a block size the CUDA kernels take)
PROMPTS = {"a": [(5 + 7 * i) % 97 for i in range(13)], "b": [(3 + 11 * i) % 89 for i in range(11)]}


def _runner(path, chained: bool, length: int = 3, device: str = "cpu") -> ModelRunner:
    """A runner of the model; on CUDA (fp32, Triton attention) with its decode graphs."""
    options = dict(block_size=BLOCK, max_model_len=48, num_kv_blocks=16, dtype="float32")
    options["device"] = device
    engine = LLM(str(path), **options, enforce_eager=True).engine
    backend = "triton" if device == "cuda" else "reference"
    runner = ModelRunner(engine.model_config, engine.platform, BLOCK, backend, seed=0)
    runner.allocate_kv_cache(engine.runner.num_blocks)
    if device == "cuda":
        runner.capture_graphs(2)
    if chained:
        runner.chain_decode_steps(length)
    return runner


def _prefill(blocks: dict[str, list[int]]) -> StepPlan:
    greedy = SamplingParams(temperature=0.0)
    ids = list(PROMPTS)
    return StepPlan(
        request_ids=ids,
        num_computed=[0, 0],
        num_new=[len(PROMPTS[r]) for r in ids],
        samples=[True, True],
        new_requests=[NewRequest(r, PROMPTS[r], len(PROMPTS[r]), greedy, None) for r in ids],
        table_updates=[TableUpdate(r, 0, 0, blocks[r]) for r in ids],
    )


def _decode(step: int) -> StepPlan:
    """Decode step ``step`` (1, 2, ...) after the prefill."""
    computed = [len(PROMPTS[r]) + step - 1 for r in PROMPTS]
    return StepPlan(list(PROMPTS), computed, [1, 1], [True, True])


def _steps(runner: ModelRunner, num_steps: int) -> list[list[int]]:
    """The prefill and ``num_steps`` decode steps, each fed the last on the device; the
    tokens of each, read at the end."""
    launched = [runner.launch(_prefill({"a": [1, 2], "b": [4, 5]}))]
    for step in range(1, num_steps + 1):
        launched.append(runner.launch(_decode(step), launched[-1]))
    return [step.result().token_ids for step in launched]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chained_steps_equal_host_prepared_ones(tiny_model_dir, device):
    """Tokens of chained decode steps (chains of three steps; each row crossing into its
    second block within one) equal those of the same steps prepared on the host (on CUDA, both
    replaying decode graphs); each chained step's metadata is the packed batch the host
    would build for it."""
    path = tiny_model_dir("llama")
    want = _steps(_runner(path, chained=False, device=device), 6)
    runner = _runner(path, chained=True, device=device)
    built = []  # each decode step's metadata

    def record(seq) -> None:
        if seq.is_decode:
            built.append(seq)

    if runner.graphs is None:
        build_views = runner.plan.build_views
        runner.plan.build_views = lambda seq: record(seq) or build_views(seq)
    else:
        run = runner.graphs.run
        runner.graphs.run = lambda seq: record(seq) or run(seq)
    chained = []
    prepare = runner.decode_chain.prepare
    runner.decode_chain.prepare = lambda *args: chained.append(prepare(*args)) or chained[-1]
    assert _steps(runner, 6) == want
    assert [step is not None for step in chained] == [False, False] + [True] * 5
    assert len(built) == 6
    assert built[-1].positions.tolist() == [18, 16]  # (b's last step in its second block)

    # Each chained step's metadata against the host's packing of its plan (tokens aside).
    for step, seq in enumerate(built[1:], start=2):
        host = runner.inputs.prepare(_decode(step), runner.requests).seq
        for field in ("positions", "kv_lens", "query_start_loc", "logits_indices"):
            torch.testing.assert_close(getattr(seq, field), getattr(host, field), msg=field)
            assert getattr(seq, field).is_contiguous(), field  # (kernels read them flat)
        (parts,), (host_parts,) = seq.group_parts, host.group_parts
        for field in ("slot_mapping", "block_tables", "table_starts"):
            got, expected = getattr(parts, field), getattr(host_parts, field)
            torch.testing.assert_close(got, expected, msg=field)
        assert parts.slot_mapping.is_contiguous()
        for field in ("query_lens_host", "kv_lens_host", "query_start_host"):
            np.testing.assert_array_equal(getattr(seq, field), getattr(host, field), field)
        assert (seq.max_kv_len, seq.max_query_len) == (host.max_kv_len, 1) and seq.is_decode


@pytest.mark.parametrize("case", ["table update", "launch between", "no block"])
def test_steps_that_cannot_chain_are_prepared_on_the_host(tiny_model_dir, case):
    """The decode step after a chainable one, but with a table update, after another launch,
    or with a row whose table lacks its next token's block."""
    runner = _runner(tiny_model_dir("llama"), chained=True)
    blocks = {"a": [1], "b": [4, 5]} if case == "no block" else {"a": [1, 2], "b": [4, 5]}
    prefill = runner.launch(_prefill(blocks))
    first = runner.launch(_decode(1), prefill)
    plan = _decode(2)  # a at position 14, b at 12
    if case == "table update":
        plan.table_updates.append(TableUpdate("b", 0, 2, [6]))
    elif case == "launch between":
        runner.launch(StepPlan(finished_ids=["gone"]))
    elif case == "no block":
        plan = StepPlan(list(PROMPTS), [16, 12], [1, 1], [True, True])  # a past its block
    assert first.next_decode is not None
    tried = []
    prepare = runner.decode_chain.prepare
    runner.decode_chain.prepare = lambda *args: tried.append(prepare(*args)) or tried[-1]
    runner.launch(plan, first).result()
    assert tried == [None]


def test_a_sliding_window_keeps_steps_on_the_host(tiny_model_dir):
    """A window moves a row's table start as it advances: no chaining."""
    engine = LLM(str(tiny_model_dir("mistral")), max_model_len=64).engine
    engine.runner.chain_decode_steps(2)
    assert not engine.runner.decode_chain.enabled
    llama = LLM(str(tiny_model_dir("llama")), max_model_len=64).engine.runner
    llama.chain_decode_steps(2)
    assert llama.decode_chain.enabled
