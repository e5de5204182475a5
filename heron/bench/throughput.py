"""``heron bench throughput``: workload A, output tokens/s of many requests at once.

Workload A is nano-vllm's ``bench.py`` workload, so that its figures and these compare:
``random.seed(0)``; 256 prompts of ``randint(100, 1024)`` token ids each drawn by
``randint(0, 10000)``; then for each request ``max_tokens = randint(100, 1024)``; temperature
0.6, EOS ignored (so every request generates exactly its ``max_tokens``: 133,966 tokens in
all); ``max_model_len`` 4096; all requests submitted at once; throughput = the sum of
``max_tokens`` over the wall time of ``generate``. nano-vllm warms up with one short request
before timing; here a warm-up of the same kind (other prompts, so no prefix-cache hits, and
32 tokens each) goes first, so that the Triton kernel variants its step shapes need are
compiled before the timed run. ``--num-seqs`` and the length bounds shrink it for the CPU.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from heron import LLM, SamplingParams
from heron.bench import engines
from heron.bench.result import Metric
from heron.config import EngineConfig

NUM_SEQS, MAX_INPUT_LEN, MAX_OUTPUT_LEN, MIN_LEN = 256, 1024, 1024, 100
MAX_MODEL_LEN, TEMPERATURE, TOKEN_ID_MAX = 4096, 0.6, 10000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    parser.add_argument("--max-input-len", type=int, default=MAX_INPUT_LEN)
    parser.add_argument("--max-output-len", type=int, default=MAX_OUTPUT_LEN)
    parser.add_argument("--min-len", type=int, default=MIN_LEN, help="of inputs and outputs")
    parser.add_argument("--workload-seed", type=int, default=0, help="of the prompts and lengths")


def workload(
    num_seqs: int = NUM_SEQS,
    max_input_len: int = MAX_INPUT_LEN,
    max_output_len: int = MAX_OUTPUT_LEN,
    seed: int = 0,
    min_len: int = MIN_LEN,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Workload A's prompts and sampling parameters, drawn in nano-vllm's order."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, TOKEN_ID_MAX) for _ in range(rng.randint(min_len, max_input_len))]
        for _ in range(num_seqs)
    ]
    params = [
        SamplingParams(
            temperature=TEMPERATURE,
            ignore_eos=True,
            max_tokens=rng.randint(min_len, max_output_len),
        )
        for _ in range(num_seqs)
    ]
    return prompts, params


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    if not args.min_len <= min(args.max_input_len, args.max_output_len):
        raise ValueError(f"--min-len {args.min_len} exceeds a maximum length")
    shape = engines.resolve_shape(args, config)
    sizes = (args.num_seqs, args.max_input_len, args.max_output_len)
    prompts, params = workload(*sizes, args.workload_seed, args.min_len)
    warm_prompts, warm_params = workload(*sizes, args.workload_seed + 1, args.min_len)
    for p in warm_params:
        p.max_tokens = min(p.max_tokens, 32)
    max_model_len = max(MAX_MODEL_LEN, args.max_input_len + args.max_output_len)
    with engines.open_llm(shape, config, max_model_len=max_model_len) as llm:
        llm.generate(warm_prompts, warm_params, use_tqdm=False)
        seconds, generated = timed_generate(llm, prompts, params)
    total = sum(p.max_tokens for p in params)
    if generated != total:
        raise RuntimeError(f"generated {generated} tokens, not the workload's {total}")
    on = engines.label(args, config)
    metrics = [
        Metric(f"{on}: workload A output tok/s", total / seconds, "tok/s"),
        Metric(f"{on}: workload A seconds", seconds, "s"),
        Metric(f"{on}: workload A output tokens", total, "tokens"),
        Metric(f"{on}: workload A prompt tokens", sum(map(len, prompts)), "tokens"),
    ]
    return {"shape": args.shape, "num_layers": args.num_layers, **vars_of(args)}, metrics


def timed_generate(llm: LLM, prompts, params, loras=None) -> tuple[float, int]:
    """Seconds of ``generate`` (under ``loras``, one each or None) and tokens generated."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("num_seqs", "max_input_len", "max_output_len", "min_len", "workload_seed")
    return {k: getattr(args, k) for k in keys}
