"""``heron bench offload``: a multi-turn workload whose working set is several times the
device pool, with and without the host-memory tier.

``--conversations`` conversations (64), each opening with one of ``--systems`` shared system
prompts (4, of ``--system-len`` random tokens: 512) and a ``--first-len``-token message of its
own (64); each later turn's prompt is the previous prompt, the previous answer and a new
``--message-len``-token message (32); answers are ``--answer-len`` tokens (16), greedy, EOS
ignored. Every turn visits the conversations round-robin, ``--batch`` at a time (4: the next
batch once they finished). The device pool holds ``1 / --working-set-ratio`` (4) of the last
turn's distinct prompt tokens (at least one sequence); the host tier, when on, holds all of
them. Per turn: the prompt tokens computed (not found in either tier) and the median time to
first token from the batch's submission; with the tier, the blocks loaded from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from typing import Any

from heron import LLM
from heron.bench import engines
from heron.bench.result import Metric
from heron.config import EngineConfig

TOKEN_ID_MAX = 10000  # (within the model's vocabulary, at most)
DEFAULTS = dict(
    conversations=64,
    systems=4,
    system_len=512,
    first_len=64,
    message_len=32,
    answer_len=16,
    turns=3,
    batch=4,
    working_set_ratio=4,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, default in DEFAULTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def max_len(args: argparse.Namespace) -> int:
    """The last turn's prompt and answer."""
    a = args
    return a.system_len + a.first_len + a.turns * a.answer_len + (a.turns - 1) * a.message_len


def working_set(args: argparse.Namespace) -> int:
    """Distinct prompt tokens of the last turn: the system prompts once, each conversation's
    own tokens."""
    own = max_len(args) - args.system_len - args.answer_len
    return args.systems * args.system_len + args.conversations * own


def _pool(args: argparse.Namespace, block_size: int) -> dict[str, int]:
    """The context, and the device pool: ``1 / --working-set-ratio`` of the working set, at
    least one sequence."""
    blocks = max(
        -(-working_set(args) // (args.working_set_ratio * block_size)),
        -(-max_len(args) // block_size),
    )
    return dict(max_model_len=max_len(args), num_kv_blocks=blocks + 1)


@dataclasses.dataclass
class Turn:
    computed: int  # prompt tokens computed
    ttft_s: list[float]


def converse(llm: LLM, args: argparse.Namespace) -> list[Turn]:
    """Every turn of every conversation (the random tokens drawn from seed 0)."""
    rng = random.Random(0)
    top = min(TOKEN_ID_MAX, llm.engine.model_config.vocab_size - 1)
    draw = lambda n: [rng.randint(2, top) for _ in range(n)]  # noqa: E731
    systems = [draw(args.system_len) for _ in range(args.systems)]
    prompts = [systems[i % args.systems] + draw(args.first_len) for i in range(args.conversations)]
    params = engines.greedy(args.answer_len)
    turns = []
    for t in range(args.turns):
        answers, turn = {}, Turn(0, [])
        for start in range(0, len(prompts), args.batch):
            batch = range(start, min(start + args.batch, len(prompts)))
            for i in batch:
                llm.add_request(f"c{i}-t{t}", prompts[i], params)
            begin, seen = time.perf_counter(), set()
            while llm.has_unfinished_requests():
                for o in llm.step():
                    if o.outputs[0].token_ids and o.request_id not in seen:
                        seen.add(o.request_id)
                        turn.ttft_s.append(time.perf_counter() - begin)
                    if o.finished:
                        i = int(o.request_id[1:].split("-")[0])
                        answers[i] = o.outputs[0].token_ids
                        turn.computed += len(prompts[i]) - o.num_cached_tokens
        turns.append(turn)
        prompts = [p + answers[i] + draw(args.message_len) for i, p in enumerate(prompts)]
    return turns


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    if min(vars(args)[name] for name in DEFAULTS) < 1:
        raise ValueError(f"--{', --'.join(n.replace('_', '-') for n in DEFAULTS)} must be >= 1")
    if config.kv_offload_bytes is not None or config.kv_transfer_config is not None:
        raise ValueError("heron bench offload sizes the host tier itself: leave out its flags")
    shape = engines.resolve_shape(args, config)
    on, metrics = engines.label(args, config), []
    config = dataclasses.replace(config, block_size=config.block_size or 16)
    block_size, bytes_per_token = config.block_size, 0
    for tier in ("without the host tier", "with the host tier"):
        options = {}
        if bytes_per_token:  # (known from the first run's cache layout)
            options["kv_offload_bytes"] = working_set(args) * bytes_per_token * 5 // 4
        with engines.open_llm(shape, config, **options, **_pool(args, block_size)) as llm:
            start = time.perf_counter()
            turns = converse(llm, args)
            wall = time.perf_counter() - start
            bytes_per_token = sum(llm.engine.runner.cache.bytes_per_block()) // block_size
            connector = llm.engine.scheduler.connector
            loaded = {m.name: m.value for m in connector.metrics()} if connector else {}
        for t, turn in enumerate(turns, 1):
            case = f"{on}, {tier}, turn {t}"
            metrics.append(Metric(f"{case}: prompt tokens computed", turn.computed, "tokens"))
            p50 = statistics.median(turn.ttft_s) * 1e3
            metrics.append(Metric(f"{case}: p50 TTFT", p50, "ms"))
        metrics.append(Metric(f"{on}, {tier}: wall time", wall, "s"))
        if loaded:
            blocks = loaded["kv_offload_loaded_blocks"]
            metrics.append(Metric(f"{on}, {tier}: blocks loaded from host", blocks, "blocks"))
    return {"shape": args.shape, "num_layers": args.num_layers, "block_size": block_size} | {
        name: vars(args)[name] for name in DEFAULTS
    }, metrics
