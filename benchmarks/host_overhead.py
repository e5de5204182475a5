"""Per-step host time of a decode step with the model forward replaced by a no-op.

Times scheduling, the packed StepBatch, SequenceMetadata (one copy) and every group's builder
for a Qwen3-0.6B-shaped plan (28 attention operators, 16 heads, 8 KV heads, head_dim 128),
at several numbers of running requests. Prints a table; run on the CPU:

    python benchmarks/host_overhead.py [--device cpu] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from heron.engine.kv_cache_manager import KVCacheCoordinator
from heron.engine.request import Request
from heron.engine.scheduler import Scheduler, SchedulerConfig
from heron.execution.step_inputs import StepInputBuilder
from heron.metadata import ModelBuildContext, StepMetaPlan
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.reference import ReferenceAttention
from heron.sampling_params import SamplingParams

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 28, 16, 8, 128
BLOCK_SIZE, MAX_MODEL_LEN, PROMPT_LEN = 16, 4096, 128


def make_plan() -> StepMetaPlan:
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    with ModelBuildContext() as scope:
        for i in range(LAYERS):
            ReferenceAttention(f"model.layers.{i}.self_attn.attn", spec, BLOCK_SIZE, MAX_MODEL_LEN)
    return StepMetaPlan.from_operators(scope.operators)


def measure(batch: int, steps: int, device: torch.device) -> dict[str, float]:
    plan = make_plan()
    blocks = batch * (PROMPT_LEN + steps + 64) // BLOCK_SIZE + batch + 1
    kv = KVCacheCoordinator([blocks], BLOCK_SIZE, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(batch, 1 << 20, MAX_MODEL_LEN), kv)
    inputs = StepInputBuilder(BLOCK_SIZE, device)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7919 + j) % 150000 for j in range(PROMPT_LEN)]
        scheduler.add(Request(str(i), prompt, params))

    timings: dict[str, list[float]] = {"schedule": [], "inputs": [], "update": []}
    for step in range(steps + 1):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        prepared = inputs.prepare(out, kv.block_tables)
        plan.build_views(prepared.seq)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        scheduler.finish_step(out)
        for r in prepared.sample_requests:
            r.append_output_token(1)  # the no-op model "samples" token 1
        t3 = time.perf_counter()
        if step:  # step 0 is the prefill
            timings["schedule"].append(t1 - t0)
            timings["inputs"].append(t2 - t1)
            timings["update"].append(t3 - t2)
    result = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
    result["total"] = sum(result.values())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"host time per decode step (median of {args.steps}), µs, device={device}")
    print(
        "| running requests | schedule | StepBatch + SequenceMetadata + builders | token update | total |"
    )
    print("| --- | --- | --- | --- | --- |")
    for batch in args.batches:
        r = measure(batch, args.steps, device)
        print(
            f"| {batch} | {r['schedule']:.0f} | {r['inputs']:.0f} | {r['update']:.0f} | {r['total']:.0f} |"
        )


if __name__ == "__main__":
    main()
