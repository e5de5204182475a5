"""``heron bench decode``: ms per decode step at given batches and contexts, and its multiple
of the bandwidth floor.

For each (context, batch) case, ``batch`` requests of ``context`` prompt tokens each generate
``--new-tokens`` tokens greedily (EOS ignored); the figure is the mean time per step while
every request decodes, per request (last token time - first token time) / (tokens - 1), as the
caller of ``LLMEngine.step`` sees it. Every case runs once briefly first, so that one-time work
(first replays, kernel compilation, allocations) falls outside the timed runs. The floor counts
the mean context of the timed steps (``context + new_tokens / 2``); for an MoE shape the experts
each step's routing touches, counted on an eager engine of its own first.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from heron import LLM
from heron.bench import engines
from heron.bench.measure import (
    copy_bandwidth,
    has_experts,
    median_of,
    steady_decode_ms,
    step_bytes,
)
from heron.bench.result import Metric
from heron.bench.shapes import Shape, dummy_checkpoint
from heron.config import EngineConfig
from heron.layers.mxfp4 import bytes_per_weight as mxfp4_bytes_per_weight
from heron.layers.wna16 import wna16_scheme
from heron.platforms import resolve_device

# Short defaults where there is no GPU: the CPU runs the same code, a few steps of it.
CPU_CONTEXT, CPU_NEW_TOKENS = 16, 4
GPU_CONTEXT, GPU_NEW_TOKENS = 128, 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="requests at once")
    parser.add_argument(
        "--context", type=int, nargs="+", default=None,
        help=f"prompt tokens per request (default: {GPU_CONTEXT}; {CPU_CONTEXT} on the CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--new-tokens", type=int, default=None,
        help=f"generated per request (default: {GPU_NEW_TOKENS}; {CPU_NEW_TOKENS} on the CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--host-idle", action="store_true",
        help="also the share of a step the GPU waits for the host (CUDA graphs)",
    )  # fmt: skip
    parser.add_argument("--hf", action="store_true", help="also HF transformers (one GPU)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs of every case, in turn; the median"
    )


def floor_bytes(
    shape: Shape, config: EngineConfig, batch: int, context: float, experts_read: float = 0.0
) -> float:
    """:func:`step_bytes` of a step under ``config``: its weights' bytes per element (FP8, a
    W4A16 scheme's or MXFP4 experts' with their scales), its cache's, its share under TP."""
    weight_bytes, expert_bytes = (1 if config.quantization else 2), None
    qc = shape.fields.get("quantization_config")
    if qc and qc["quant_method"] == "mxfp4":  # the experts', with their scales
        expert_bytes = mxfp4_bytes_per_weight()
    elif qc:  # --weight-format: with scales and zeros
        weight_bytes = wna16_scheme(qc, None).bytes_per_weight(shape.fields["hidden_size"])
    kv_bytes = 1 if config.kv_cache_dtype == "fp8" else 2
    tp = config.tensor_parallel_size
    return step_bytes(shape, batch, context, experts_read, weight_bytes, kv_bytes, tp, expert_bytes)


def prompts(context: int, batch: int) -> list[list[int]]:
    return [[3 + i] * context for i in range(batch)]


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    shape = engines.resolve_shape(args, config)
    device = resolve_device(config.device)
    on_gpu = device.type == "cuda"
    contexts = args.context or [GPU_CONTEXT if on_gpu else CPU_CONTEXT]
    new = args.new_tokens or (GPU_NEW_TOKENS if on_gpu else CPU_NEW_TOKENS)
    cases = [(c, b) for c in contexts for b in args.batch]
    longest = max(contexts) + new + 16
    options = dict(max_model_len=max(longest, 4096) if on_gpu else longest)
    touched = {b: 0.0 for b in args.batch}
    if shape is not None and has_experts(shape):
        eager = dataclasses.replace(config, enforce_eager=True)  # (hooks see no replay)
        with engines.open_llm(shape, eager, **options) as llm:
            counts = {b: engines.touched_experts(llm, prompts(16, b)) for b in args.batch}
        touched = {b: statistics.mean(n) for b, n in counts.items()}
    metrics: list[Metric] = []
    with engines.open_llm(shape, config, **options) as llm:
        for c, b in cases:
            llm.generate(prompts(c, b), engines.greedy(4), use_tqdm=False)
        runs: dict[tuple[int, int], list[tuple[float, float]]] = {case: [] for case in cases}
        for _ in range(args.repeats):
            for c, b in cases:
                runs[c, b].append(engines.timed_decode(llm, prompts(c, b), new))
        idle = (
            host_idle(llm, prompts(contexts[0], max(args.batch)), new) if args.host_idle else None
        )
    floors = dict.fromkeys(cases)
    if on_gpu and shape is not None:
        bandwidth = copy_bandwidth(device)
        for c, b in cases:
            floors[c, b] = floor_bytes(shape, config, b, c + new / 2, touched[b]) / bandwidth * 1e3
    on = engines.label(args, config)
    for (c, b), results in runs.items():
        ms, ms_spread = median_of([ms for ms, _ in results])
        tps, tps_spread = median_of([tps for _, tps in results])
        case = f"{on}, context {c}, batch {b}"
        metrics.append(Metric(f"{case}: ms/step", ms, "ms", floors[c, b], ms_spread))
        metrics.append(Metric(f"{case}: output tok/s", tps, "tok/s", note=tps_spread))
        if touched[b]:
            metrics.append(
                Metric(f"{on}, batch {b}: experts touched per MoE layer", touched[b], "experts")
            )
    if idle is not None:
        name = f"{on}, context {contexts[0]}, batch {max(args.batch)}: GPU waiting for the host"
        metrics.append(Metric(name, idle * 100, "% of a step"))
    if args.hf:
        if config.tensor_parallel_size != 1 or shape is None or args.weight_format:
            raise ValueError(
                "--hf runs a --shape on one GPU (tensor_parallel_size 1), in bf16 (no "
                "--weight-format)"
            )
        metrics += hf_metrics(shape, args.shape or "qwen3-0.6b", cases, new, floors)
    return {
        "shape": args.shape,
        "num_layers": args.num_layers,
        "cases": cases,
        "new_tokens": new,
        "repeats": args.repeats,
    }, metrics


def host_idle(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """The share of a decode step the GPU waits for the host, in a run of its own (its CUDA
    events add host work): CUDA events around each graph replay give the GPU time of a step
    (host work between them, the fill, counts as GPU time: a lower bound on the idle time);
    only replays with every request in the batch count."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        raise ValueError("--host-idle measures CUDA graph replays: drop --enforce-eager")
    replay, events = graphs.run, []

    def timed(seq):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(seq)
        end.record()
        events.append((seq.num_reqs, start, end))
        return out

    graphs.run = timed
    try:
        step_ms, _ = engines.timed_decode(llm, prompts, new_tokens)
    finally:
        graphs.run = replay
    torch.cuda.synchronize()
    gpu_ms = statistics.median(s.elapsed_time(e) for n, s, e in events if n == len(prompts))
    return max(0.0, 1 - gpu_ms / step_ms)


def hf_metrics(shape, name: str, cases, new: int, floors: dict) -> list[Metric]:
    """HF transformers' continuous batching (``generate_batch``) on the same shape (its own
    random init), timed as Heron's; its plain ``generate`` at batch 1 where continuous
    batching does not take the model."""
    import transformers as tf

    out = []
    with dummy_checkpoint(shape) as path, torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(
            tf.AutoConfig.from_pretrained(path), dtype=torch.bfloat16
        ).eval()
        for c, b in cases:
            try:
                ms = hf_batch_ms(model, prompts(c, b), new)
            except Exception as e:  # its continuous batching may not take the model
                if b != 1:
                    raise ValueError(f"HF continuous batching failed at batch {b}: {e}") from e
                ms = hf_generate_ms(model, prompts(c, 1)[0], new)
            what = f"HF transformers, {name}, context {c}, batch {b}: ms/step"
            out.append(Metric(what, ms, "ms", floors[c, b]))
    return out


def hf_batch_ms(model, prompts: list[list[int]], new: int) -> float:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = model.generate_batch(prompts, generation_config=cfg, record_timestamps=True)
    return steady_decode_ms([o.timestamps for o in outs.values()])


def hf_generate_ms(model, prompt: list[int], new: int) -> float:
    """Batch-1 ms per token through HF's plain ``generate``: ``new`` tokens less one, over
    ``new - 1``."""
    ids = torch.tensor([prompt], device=model.device)
    if "paged" in (model.config._attn_implementation or ""):
        model.set_attn_implementation("sdpa")  # continuous batching left its paged form

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)
    return (timed(new) - timed(1)) / (new - 1) * 1e3
