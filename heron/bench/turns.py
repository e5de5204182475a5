"""``heron bench turns``: multi-turn conversations, and how much of each turn's prompt is
computed again.

``--conversations`` conversations (32) of ``--turns`` turns (6): the first prompt is
``--first-len`` random tokens (1000), each later one the previous prompt, the previous answer
and a new message of ``--message-len`` random tokens (100); every answer is ``--answer-len``
tokens (500), greedy, EOS ignored. A turn's requests are submitted at once, the next turn's when
all have finished. Per turn: the prompt tokens computed (those not found in the prefix cache,
summed over the conversations), the cached ones, and the mean time to first token from the
turn's submission. It runs twice: as configured (a hybrid model checkpoints the recurrent
state of generated tokens as ``--decode-checkpoint-interval`` says), and with
``--decode-checkpoint-interval -1`` (states only where prefill chunks end), where a turn also
computes the previous answer again. Default shape: qwen3.5-0.8b.
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

CONVERSATIONS, TURNS, FIRST_LEN, MESSAGE_LEN, ANSWER_LEN = 32, 6, 1000, 100, 500
TOKEN_ID_MAX = 10000  # (within the model's vocabulary, at most)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--first-len", type=int, default=FIRST_LEN, help="first prompt tokens")
    parser.add_argument("--message-len", type=int, default=MESSAGE_LEN, help="each new message")
    parser.add_argument("--answer-len", type=int, default=ANSWER_LEN, help="tokens per answer")


@dataclasses.dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # the mean over the turn's requests


def converse(llm: LLM, args: argparse.Namespace) -> list[Turn]:
    """Every turn of every conversation (the random tokens drawn from seed 0)."""
    rng = random.Random(0)
    top = min(TOKEN_ID_MAX, llm.engine.model_config.vocab_size - 1)
    draw = lambda n: [rng.randint(2, top) for _ in range(n)]  # noqa: E731
    params = engines.greedy(args.answer_len)
    prompts = [draw(args.first_len) for _ in range(args.conversations)]
    turns = []
    for t in range(args.turns):
        for i, prompt in enumerate(prompts):
            llm.add_request(f"c{i}-t{t}", prompt, params)
        start, first, done = time.perf_counter(), {}, {}
        while llm.has_unfinished_requests():
            outputs = llm.step()
            now = time.perf_counter()
            for o in outputs:
                if o.outputs[0].token_ids:
                    first.setdefault(o.request_id, now - start)
                if o.finished:
                    done[o.request_id] = o
        outs = [done[f"c{i}-t{t}"] for i in range(args.conversations)]
        turns.append(
            Turn(
                sum(map(len, prompts)),
                sum(o.num_cached_tokens for o in outs),
                statistics.mean(first.values()),
            )
        )
        prompts = [
            p + o.outputs[0].token_ids + draw(args.message_len) for p, o in zip(prompts, outs)
        ]
    return turns


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    if config.decode_checkpoint_interval < 0:
        raise ValueError("the run with decode checkpoints needs --decode-checkpoint-interval >= 0")
    if min(args.conversations, args.turns, args.first_len, args.answer_len) < 1:
        raise ValueError("--conversations, --turns, --first-len and --answer-len must be >= 1")
    if args.shape is None and config.model is None:
        args.shape = "qwen3.5-0.8b"  # (so the figures are labelled with it)
    shape = engines.resolve_shape(args, config)
    max_len = args.first_len + args.turns * args.answer_len + (args.turns - 1) * args.message_len
    runs = {
        f"decode checkpoints (interval {config.decode_checkpoint_interval})": config,
        "no decode checkpoints": dataclasses.replace(config, decode_checkpoint_interval=-1),
    }
    on, metrics = engines.label(args, config), []
    for name, engine_config in runs.items():
        with engines.open_llm(shape, engine_config, max_model_len=max_len) as llm:
            turns = converse(llm, args)
        for t, turn in enumerate(turns, 1):
            case = f"{on}, {name}, turn {t}"
            computed = turn.prompt_tokens - turn.cached_tokens
            metrics.append(Metric(f"{case}: prompt tokens computed", computed, "tokens"))
            metrics.append(Metric(f"{case}: prompt tokens cached", turn.cached_tokens, "tokens"))
            metrics.append(Metric(f"{case}: mean TTFT", turn.ttft_s * 1e3, "ms"))
    keys = ("conversations", "turns", "first_len", "message_len", "answer_len")
    return {"shape": args.shape, "num_layers": args.num_layers} | {
        k: getattr(args, k) for k in keys
    }, metrics
