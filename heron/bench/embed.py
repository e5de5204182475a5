"""``heron bench embed``: embedding throughput, inputs/s and tokens/s, of a pooling model.

For each input length and batch size, ``batch`` inputs of exactly that many random token ids
(seeded, distinct in every run, so nothing comes from the prefix cache) are embedded in one
``LLM.embed`` call, timed after a warm-up call of the same shape. The shape (by default
Qwen3-0.6B's, as Qwen3-Embedding-0.6B) runs as a last-token pooling model.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

from heron.bench import engines
from heron.bench.result import Metric
from heron.config import EngineConfig

BATCHES = [1, 4, 16, 64, 256]
INPUT_LENS = [128, 512]
TOKEN_ID_MAX = 10000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=BATCHES, help="inputs a call")
    parser.add_argument(
        "--input-len", type=int, nargs="+", default=INPUT_LENS, help="tokens an input"
    )


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    if config.runner == "generate":
        raise ValueError("heron bench embed runs a pooling model, not --runner generate")
    shape = engines.resolve_shape(args, config)
    rng = random.Random(0)

    def inputs(batch: int, length: int) -> list[list[int]]:
        return [[rng.randint(0, TOKEN_ID_MAX) for _ in range(length)] for _ in range(batch)]

    on = engines.label(args, config)
    metrics = []
    config = dataclasses.replace(config, runner="pooling")
    with engines.open_llm(shape, config, max_model_len=max(args.input_len)) as llm:
        for length in args.input_len:
            for batch in args.batch:
                llm.embed(inputs(batch, length), use_tqdm=False)  # warm-up
                prompts = inputs(batch, length)
                start = time.perf_counter()
                llm.embed(prompts, use_tqdm=False)
                seconds = time.perf_counter() - start
                name = f"{on}, {length}-token inputs, batch {batch}"
                metrics += [
                    Metric(f"{name}: inputs/s", batch / seconds, "inputs/s"),
                    Metric(f"{name}: tokens/s", batch * length / seconds, "tok/s"),
                ]
    figures = {"batch": args.batch, "input_len": args.input_len, "runner": config.runner}
    return {"shape": args.shape, "num_layers": args.num_layers, **figures}, metrics
