"""CUDA graphs: buckets, replay equals eager, and the before_capture hook (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from heron import LLM, SamplingParams
from heron.execution.cuda_graph import CudaGraphRunner, graph_buckets
from heron.metadata import (
    GraphSupport,
    MetadataBuilder,
    MetadataOperator,
    ModelBuildContext,
    StepMetaPlan,
)


def test_buckets():
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and graph_buckets(256)[-1] == 256
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]


def _run_staggered(llm: LLM) -> dict[str, list[int]]:
    """Requests join and finish between steps; 64+ decode steps in all."""
    results: dict[str, list[int]] = {}
    arrivals = {0: 3, 5: 2, 12: 4, 30: 1}  # step -> number of new requests
    step, added = 0, 0
    while step < 90 or llm.has_unfinished_requests():
        for _ in range(arrivals.get(step, 0)):
            prompt = [(added * 13 + j) % 300 + 1 for j in range(5 + 9 * added)]
            params = SamplingParams(temperature=0, max_tokens=20 + 7 * added, ignore_eos=True)
            llm.add_request(f"r{added}", prompt, params)
            added += 1
        for out in llm.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_replay_equals_eager(tiny_model_dir, family):
    path = str(tiny_model_dir(family))
    options = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=128)
    graphs = LLM(path, cuda_graph_max_bs=8, **options)
    assert graphs.engine.runner.graphs is not None
    replayed = []
    run = graphs.engine.runner.graphs.run
    graphs.engine.runner.graphs.run = lambda seq: replayed.append(seq.num_reqs) or run(seq)
    eager = LLM(path, enforce_eager=True, **options)
    assert eager.engine.runner.graphs is None
    assert _run_staggered(graphs) == _run_staggered(eager)
    assert len(replayed) >= 64 and len(set(replayed)) > 1  # several buckets were used


@pytest.mark.gpu
def test_greedy_decode_steps_take_the_graphs_tokens(tiny_model_dir):
    """A replayed step whose requests are all greedy takes the argmax the graph computed, with
    no sampling after the replay; a step that samples still runs the sampler after it."""
    path = str(tiny_model_dir("qwen3"))
    options = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=128)
    llm = LLM(path, cuda_graph_max_bs=8, **options)
    runner = llm.engine.runner
    events: list[str] = []
    run, sample = runner.graphs.run, runner.sampler.sample_on_device
    runner.graphs.run = lambda seq: events.append("replay") or run(seq)
    runner.sampler.sample_on_device = lambda *a: events.append("sample") or sample(*a)
    prompts = [[3 + i, 5, 7 + i] for i in range(4)]

    def after_replays(params: SamplingParams) -> tuple[int, list[str]]:
        """The replays of a generation and what followed each (the last one: nothing)."""
        events.clear()
        llm.generate(prompts, params, use_tqdm=False)
        return events.count("replay"), [b for a, b in zip(events, events[1:]) if a == "replay"]

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    replays, followers = after_replays(greedy)
    assert replays >= 8 and "sample" not in followers
    replays, followers = after_replays(
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1)
    )
    assert replays >= 8 and followers == ["sample"] * replays
    # and the graph's tokens are the eager engine's
    eager = LLM(path, enforce_eager=True, **options)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)
    ]


class _LazyBuilder(MetadataBuilder):
    """Its view computes a device tensor on first use and caches it in the graph buffers, like
    a split-K partition initialised during warm-up."""

    graph_support = GraphSupport.DECODE_ONLY

    def __init__(self, reset: bool) -> None:
        self.reset = reset

    @property
    def key(self):
        return ("lazy", self.reset)

    def build(self, seq):
        raise AssertionError("graph steps never build eagerly")

    def make_graph_buffers(self, max_batch, device):
        return {"kv_lens": torch.zeros(max_batch, device=device), "cached": None}

    def fill(self, seq, buffers, batch):
        buffers["kv_lens"][: seq.num_reqs].copy_(seq.kv_lens)

    def graph_view(self, seq, buffers, batch):
        return buffers

    def before_capture(self, buffers):
        if self.reset:
            buffers["cached"] = None


class _LazyOp(MetadataOperator):
    def __init__(self, reset: bool) -> None:
        super().__init__("lazy.op")
        self._builder = _LazyBuilder(reset)

    def metadata_builder(self):
        return self._builder

    def forward(self, x):
        view = self.view
        if view["cached"] is None:
            view["cached"] = view["kv_lens"] * 2  # computed lazily, once
        return x + view["cached"][: x.shape[0], None]


class _TinyModel(torch.nn.Module):
    def __init__(self, reset: bool) -> None:
        super().__init__()
        self.op = _LazyOp(reset)

    def forward(self, token_ids):
        return self.op(token_ids.float()[:, None].repeat(1, 4))

    def compute_logits(self, hidden):
        return hidden


@pytest.mark.gpu
@pytest.mark.parametrize("reset", [True, False])
def test_before_capture_makes_replay_recompute_lazy_metadata(reset):
    from heron.metadata import SequenceMetadata, StepBatch

    with ModelBuildContext() as scope:
        model = _TinyModel(reset).cuda()
    plan = StepMetaPlan.from_operators(scope.operators)
    runner = CudaGraphRunner(model, plan, torch.device("cuda"), max_batch=2)
    runner.capture(16, [])  # warm-up with kv_lens 1 caches 2 unless reset

    step = StepBatch(2, 2, 2, 16, [])  # the model reads no cache group
    step.query_lens[:] = 1
    step.kv_lens[:] = [5, 9]
    step.finish()
    _, logits, _ = runner.run(SequenceMetadata.from_step_batch(step, torch.device("cuda")))
    recomputed = logits[:, 0].tolist() == [10.0, 18.0]
    assert recomputed == reset
