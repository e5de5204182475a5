"""Host cost of a model proposer's passes (case H of ``speculative_decode.py``), on the CPU.

Batch 1 with tiny random models whose forward, logits and sampling are stubs (every token 0,
so every proposal is accepted), and graph replays emulated by their host work alone (the
step's tokens copied and every metadata builder's ``fill`` into the graph buffers, the replay
itself skipped): what is left is the host's Python per pass, which on a GPU decides whether
the device or the host bounds the proposer's steps. Cases: MTP on a Qwen3.5-shaped target
(one MTP layer) at k = 1..3, and a 2-layer draft model of a Qwen3-shaped target at ``--k``,
with synchronous and asynchronous verification. Each is run with the proposer's decode steps
chained on the device (``ModelRunner.chain_decode_steps``) and with each prepared on the host.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

from heron import LLM, SamplingParams
from heron.execution.cuda_graph import CudaGraphRunner, _dummy_step

from gpu_decode import save_config_only

QWEN3_TINY = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    vocab_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
QWEN3_5_TINY = QWEN3_TINY | dict(
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    mtp_num_hidden_layers=1,
)
MAX_BATCH = 2


class _NoReplay:
    def replay(self) -> None:
        pass


class HostReplay(CudaGraphRunner):
    """``CudaGraphRunner`` on the CPU without graphs: a replay does its host work (tokens and
    builder fills into the graph buffers) and returns zeros, as the stub model does."""

    def capture(self, block_size, group_parts) -> None:
        for q in self.query_lens:
            for batch in self.buckets_of[q]:
                self._fill(_dummy_step(batch, q, block_size, self.device, group_parts), batch)
                hidden = self.model(self.token_ids[: batch * q])
                logits = self.model.compute_logits(hidden)
                greedy = torch.zeros(len(logits), dtype=torch.int64)
                self.graphs[batch, q] = (_NoReplay(), hidden, logits, greedy)


def _stub(runner, num_verified: int) -> None:
    """The runner's model as zeros, its graphs as their host work."""
    model = runner.model
    hidden_size = runner.model_config.hf_config.get_text_config().hidden_size
    model.forward = lambda token_ids: torch.zeros(token_ids.shape[0], hidden_size)
    model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 8)
    runner.plan.build_views = lambda seq: None
    graphs = HostReplay(model, runner.plan, runner.device, MAX_BATCH, {num_verified: MAX_BATCH})
    graphs.capture(runner.block_size, runner.inputs.parts)
    runner.graphs = graphs


def _engine(path: Path, speculative: dict) -> LLM:
    options = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=2048)
    options["attention_backend"] = "triton"  # (builders of uniform steps; no kernel runs)
    llm = LLM(str(path), **options, max_num_seqs=1, speculative_config=speculative)
    engine, q = llm.engine, 1 + speculative["num_speculative_tokens"]
    _stub(engine.runner, q)
    _stub(engine.draft_runner, q)
    scheduler = engine.scheduler
    scheduler.config = replace(scheduler.config, uniform_proposals_up_to=MAX_BATCH)
    return llm


class _OpCount(TorchDispatchMode):
    """Counts the ATen operators run (each a launch, or a view, on a GPU's host)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))


def _measure(llm: LLM, steps: int) -> dict[bool, tuple[float, float, float, float, float]]:
    """Whether decode steps are chained -> (µs of host per pass, per proposer step, per
    engine step, ATen operators per pass, of them views): medians over ``steps`` engine
    steps after a warm-up, the two ways taking turns step by step (so that a busy host slows
    both alike), then the operators of a quarter as many passes each way."""
    engine = llm.engine
    proposer, runner = engine.model_proposer, engine.draft_runner
    passes, launches, counting = [], [0], [None]
    propose, launch = proposer.propose, runner.launch

    def timed_propose(*args, **kwargs):
        start = time.perf_counter()
        try:
            if counting[0] is None:
                return propose(*args, **kwargs)
            with counting[0]:
                return propose(*args, **kwargs)
        finally:
            passes.append(time.perf_counter() - start)

    def counted_launch(*args, **kwargs):
        launches[0] += 1
        return launch(*args, **kwargs)

    proposer.propose, runner.launch = timed_propose, counted_launch
    params = SamplingParams(temperature=0, max_tokens=steps * 8, ignore_eos=True)

    def add(request_id: str) -> None:
        engine.add_request(request_id, list(range(2, 130)), params)
        for _ in range(10):
            engine.step()

    add("timed")
    times = {False: ([], [], []), True: ([], [], [])}  # passes, steps per pass, engine steps
    for i in range(2 * steps):
        chained = bool(i % 2)
        runner.chains_decode_steps = chained
        pass_times, steps_per_pass, step_times = times[chained]
        passes.clear()
        launches[0] = 0
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        if passes and launches[0]:
            pass_times.append(passes[0])
            steps_per_pass.append(launches[0])
    engine.abort_request("timed")
    ops = {}
    for chained in (False, True):
        runner.chains_decode_steps = chained
        add(f"counted {chained}")
        counting[0] = _OpCount()
        passes.clear()
        for _ in range(steps // 4):
            engine.step()
        ops[chained] = (counting[0].ops / len(passes), counting[0].views / len(passes))
        counting[0] = None
        engine.abort_request(f"counted {chained}")
    proposer.propose, runner.launch = propose, launch
    return {
        chained: (
            statistics.median(p) * 1e6,
            statistics.median(p) / statistics.mean(n) * 1e6,
            statistics.median(e) * 1e6,
            *ops[chained],
        )
        for chained, (p, n, e) in times.items()
    }


def case_h(args) -> None:
    torch.set_num_threads(1)  # (the host's work of a GPU step: no CPU kernels to spread)
    print(
        "| proposer | decode steps | µs of host per pass | µs per proposer step "
        "| µs per engine step | ATen operators per pass (views) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        mtp, target, draft = Path(tmp, "mtp"), Path(tmp, "target"), Path(tmp, "draft")
        save_config_only(tf.Qwen3_5TextConfig(**QWEN3_5_TINY), "Qwen3_5ForCausalLM", mtp)
        save_config_only(tf.Qwen3Config(**QWEN3_TINY), "Qwen3ForCausalLM", target)
        draft_shape = QWEN3_TINY | {"num_hidden_layers": 2}
        save_config_only(tf.Qwen3Config(**draft_shape), "Qwen3ForCausalLM", draft)
        runs = [
            (f"mtp k={k}", mtp, {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)
        ]
        for ahead in (False, True):
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
            name = f"2-layer draft k={args.k}" + (", async verification" if ahead else "")
            runs.append((name, target, spec | {"async_verification": ahead}))
        for name, path, spec in runs:
            results = _measure(_engine(path, spec), args.host_steps)
            for chained, (pass_us, step_us, engine_us, ops, views) in results.items():
                how = "chained on the device" if chained else "each prepared on the host"
                print(
                    f"| {name} | {how} | {pass_us:.0f} | {step_us:.0f} | {engine_us:.0f} "
                    f"| {ops:.0f} ({views:.0f}) |"
                )
