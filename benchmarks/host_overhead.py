"""Per-step host time of a decode step with the model forward replaced by a no-op.

Times scheduling, the packed StepBatch, SequenceMetadata (one copy) and every group's builder
for a Qwen3-0.6B-shaped plan (28 attention operators, 16 heads, 8 KV heads, head_dim 128) or a
Gemma-3-1B-shaped one (26 operators, five with a 512-token window to one full, two KV cache
groups), at several numbers of running requests. Prints a table; run on the CPU:

    python benchmarks/host_overhead.py [--shape gemma3] [--prompt-len 4096] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from heron.cache import FullAttentionSpec, KVCacheCoordinator, SlidingWindowSpec
from heron.engine.request import Request
from heron.engine.scheduler import Scheduler, SchedulerConfig
from heron.execution.model_runner import apply_plan
from heron.execution.step_inputs import StepInputBuilder
from heron.metadata import ModelBuildContext, StepMetaPlan
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.reference import ReferenceAttention
from heron.sampling_params import SamplingParams

BLOCK_SIZE = 16
# (layers, heads, KV heads, head_dim, sliding window, full layer every n-th)
SHAPES = {"qwen3": (28, 16, 8, 128, None, 1), "gemma3": (26, 4, 1, 256, 512, 6)}


def make_plan(shape: str, max_model_len: int) -> StepMetaPlan:
    layers, heads, kv_heads, head_dim, window, every = SHAPES[shape]
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5)
    sliding = AttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    with ModelBuildContext() as scope:
        for i in range(layers):
            layer_spec = spec if window is None or (i + 1) % every == 0 else sliding
            name = f"model.layers.{i}.self_attn.attn"
            ReferenceAttention(name, layer_spec, BLOCK_SIZE, max_model_len)
    plan = StepMetaPlan.from_operators(scope.operators)
    for group in plan.groups:  # cache groups as the runner assigns them: full first
        group.builder.cache_group = int(group.builder.sliding_window is not None)
    return plan


def measure(
    batch: int, steps: int, device: torch.device, shape: str, prompt_len: int
) -> dict[str, float]:
    max_model_len = prompt_len + steps + 64
    plan = make_plan(shape, max_model_len)
    window = SHAPES[shape][4]
    windows = [None] if window is None else [None, window]
    blocks = batch * max_model_len // BLOCK_SIZE + batch + 1
    kv_heads, head_dim = SHAPES[shape][2:4]
    specs = [
        FullAttentionSpec(BLOCK_SIZE, torch.bfloat16, kv_heads, head_dim)
        if w is None
        else SlidingWindowSpec(BLOCK_SIZE, torch.bfloat16, kv_heads, head_dim, w)
        for w in windows
    ]
    kv = KVCacheCoordinator(specs, [blocks] * len(specs), enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(batch, 1 << 20, max_model_len), kv)
    inputs = StepInputBuilder(BLOCK_SIZE, device, specs)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7919 + j) % 150000 for j in range(prompt_len)]
        scheduler.add(Request(str(i), prompt, params))

    timings: dict[str, list[float]] = {"schedule": [], "inputs": [], "update": []}
    states = {}
    for step in range(steps + 1):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        apply_plan(out.plan, states, inputs.tables, device)
        prepared = inputs.prepare(out.plan, states)
        plan.build_views(prepared.seq)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        scheduler.finish_step(out)
        for item in out.scheduled:  # the no-op model "samples" token 1
            item.request.append_output_token(1)
            states[item.request.request_id].all_token_ids.append(1)
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"host time per decode step (median of {args.steps}), µs, {args.shape} plan, "
        f"{args.prompt_len}-token prompts, device={device}"
    )
    print(
        "| running requests | schedule | StepBatch + SequenceMetadata + builders | token update | total |"
    )
    print("| --- | --- | --- | --- | --- |")
    for batch in args.batches:
        r = measure(batch, args.steps, device, args.shape, args.prompt_len)
        print(
            f"| {batch} | {r['schedule']:.0f} | {r['inputs']:.0f} | {r['update']:.0f} | {r['total']:.0f} |"
        )


if __name__ == "__main__":
    main()
