"""``heron bench host``: the host time of a whole engine decode step, everything but the model.

A shape (default Gemma-3-1B: 26 layers, five sliding-window layers to one full, two KV cache
groups, a 262,144-token vocabulary) is built with tiny matrices (hidden size 32) on the CPU,
and its forward, logits and sampling are replaced by stubs that draw random tokens over the
whole vocabulary. ``--batch`` requests of ``--context`` prompt tokens are added (the stub makes
prefill free) and, after ten warm-up steps, ``LLM.step`` is timed: scheduling, the KV
cache, step inputs, detokenisation, stop checks and (streamed) outputs. The mean is what a
decode benchmark's ms per step sees; it is above the median because requests crossing a block
boundary take the KV cache's slow path (all at once here: the prompts have one length).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch

from heron import LLM, SamplingParams
from heron.bench.result import Metric
from heron.bench.shapes import dummy_checkpoint, shape
from heron.platforms import CudaPlatform

TINY = dict(hidden_size=32, head_dim=16, intermediate_size=32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="gemma-3-1b", help="layers and vocabulary of")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument(
        "--block-size", type=int, default=CudaPlatform.default_block_size,
        help="tokens per KV cache block (default: CUDA's)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--no-stream", action="store_true", help="outputs only when finished")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the steps")


def stubbed_engine(name: str, max_model_len: int, block_size: int) -> LLM:
    """The shape's layers and vocabulary with tiny matrices, its model and sampler stubbed."""
    tiny = shape(name).with_fields(**TINY, max_position_embeddings=max_model_len)
    if tiny.family != "dense":
        raise ValueError(f"--shape must be a dense shape (qwen3-0.6b, gemma-3-1b), got {name!r}")
    vocab = tiny.fields["vocab_size"]
    with dummy_checkpoint(tiny) as path:
        llm = LLM(
            path, load_format="dummy", max_model_len=max_model_len, block_size=block_size,
            device="cpu", dtype="float32", enforce_eager=True, max_num_batched_tokens=1 << 20,
        )  # fmt: skip
    runner = llm.engine.runner
    draws = torch.Generator().manual_seed(0)
    runner.model.forward = lambda token_ids: torch.zeros(token_ids.shape[0], 8)
    runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 8)
    runner.plan.build_views = lambda seq: None
    runner.sampler.sample_on_device = lambda logits, requests, generator, bitmask=None: (
        torch.randint(vocab, (logits.shape[0],), generator=draws)
    )
    return llm


def run(args: argparse.Namespace, config: Any = None) -> tuple[dict[str, Any], list[Metric]]:
    llm = stubbed_engine(args.shape, args.context + args.steps + 64, args.block_size)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True)
    for i in range(args.batch):
        llm.add_request(f"r{i}", [3 + i] * args.context, params, stream=not args.no_stream)
    for _ in range(10):
        llm.step()
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        llm.step()
        if profiler is not None:
            profiler.disable()
        times.append(time.perf_counter() - start)
    llm.shutdown()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    case = f"{args.shape}, batch {args.batch}, context {args.context}, blocks of {args.block_size}"
    case += ", not streamed" if args.no_stream else ""
    metrics = [
        Metric(f"{case}: host µs per engine step (median)", statistics.median(times) * 1e6, "µs"),
        Metric(f"{case}: host µs per engine step (mean)", statistics.mean(times) * 1e6, "µs"),
    ]
    keys = ("shape", "batch", "context", "block_size", "steps", "no_stream")
    return {k: getattr(args, k) for k in keys}, metrics
