"""``heron bench spec``: speculative decoding against plain decoding.

The same requests are decoded greedily without and with ``--speculative-config`` (default:
n-gram, 4 tokens, lookups up to 4), ``--batch`` requests at a time, each timed from its first
token to its last: ms per output token, output tokens/s, the mean acceptance length, and how
many outputs are identical to plain decoding's (in bf16 a verification step and a decode step
sum in different orders, so outputs may part at near-ties). On the default model (no
``--shape`` or ``--model``) the prompts ask to repeat or edit a given text, which n-gram
speculation serves; on a random-weight ``--shape`` they are random tokens (``--mtp`` gives the
shape an MTP head). With an n-gram config, the proposer's own cost per lookup is measured too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import numpy as np

from heron import LLM, SamplingParams
from heron.bench import engines
from heron.bench.result import Metric
from heron.config import EngineConfig
from heron.speculative import NgramProposer, SpecDecodeStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
TEXTS = [
    "The heron stood still in the shallow water of the river. It waited for a fish to swim "
    "past its long legs, and when one came close, it struck with its sharp beak. Then it "
    "flew to a tall tree on the bank and rested there until the evening.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
    "    return total / len(values)\n",
    "Monday: buy bread, milk and eggs. Tuesday: call the plumber about the kitchen sink. "
    "Wednesday: return the library books. Thursday: pay the electricity bill. Friday: "
    "water the plants and clean the windows.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, changing nothing but replacing every full stop with an "
    "exclamation mark:",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="requests at once")
    parser.add_argument("--max-tokens", type=int, default=256, help="per request")
    parser.add_argument("--mtp", action="store_true", help="give --shape one MTP layer")


def prompts(llm: LLM, random_tokens: bool, vocab_size: int) -> list[list[int]]:
    if random_tokens:
        rng = np.random.default_rng(0)
        return [rng.integers(2, vocab_size, 128).tolist() for _ in range(len(TEXTS))]
    return [
        llm.apply_chat_template([{"role": "user", "content": f"{i}\n\n{t}"}])
        for t in TEXTS
        for i in INSTRUCTIONS
    ]


def timed_decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int):
    """(ms per output token, output tokens/s, outputs): ``batch`` requests at a time, each
    timed from its first token to its last."""
    per_token, outputs, tokens = [], [], 0
    start_all = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        for i, prompt in enumerate(group):
            llm.add_request(str(first + i), prompt, params)
        times: dict[str, list[float]] = {}
        done: dict[str, list[int]] = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                times.setdefault(out.request_id, []).append(time.perf_counter())
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        for request_id, ids in done.items():
            if len(ids) > 1:
                per_token.append((times[request_id][-1] - times[request_id][0]) / (len(ids) - 1))
            tokens += len(ids)
        outputs += [done[str(first + i)] for i in range(len(group))]
    wall = time.perf_counter() - start_all
    return statistics.mean(per_token) * 1e3, tokens / wall, outputs


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    shape = engines.resolve_shape(args, config, default=None)
    speculative = config.speculative_config or NGRAM
    configs = {
        "plain": dataclasses.replace(config, speculative_config=None),
        "speculative": dataclasses.replace(config, speculative_config=speculative),
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=shape is not None)
    options = dict(max_model_len=2048)
    results: dict[str, dict[int, tuple]] = {}
    for name, engine_config in configs.items():
        with engines.open_llm(shape, engine_config, **options) as llm:
            vocab = shape.fields["vocab_size"] if shape is not None else 0
            work = prompts(llm, shape is not None, vocab)
            for batch in args.batch:
                # every prompt once at least, ``batch`` at a time
                batch_work = (work * -(-batch // len(work)))[: max(batch, len(work))]
                warm = dataclasses.replace(params, max_tokens=8)
                timed_decode(llm, batch_work[:batch], warm, batch)
                llm.engine.spec_decode_stats = SpecDecodeStats()
                ms, tps, outs = timed_decode(llm, batch_work, params, batch)
                results.setdefault(name, {})[batch] = (ms, tps, outs, llm.spec_decode_stats)
    how = f"{engines.label(args, config)}, {speculative['method']} k={speculative['num_speculative_tokens']}"
    metrics = []
    for batch in args.batch:
        plain_ms, plain_tps, plain_outs, _ = results["plain"][batch]
        ms, tps, outs, stats = results["speculative"][batch]
        same = sum(a == b for a, b in zip(outs, plain_outs))
        on = f"{how}, batch {batch}"
        metrics += [
            Metric(f"{on}: plain ms/output token", plain_ms, "ms"),
            Metric(f"{on}: speculative ms/output token", ms, "ms"),
            Metric(f"{on}: speed-up", plain_ms / ms, "x"),
            Metric(f"{on}: plain output tok/s", plain_tps, "tok/s"),
            Metric(f"{on}: speculative output tok/s", tps, "tok/s"),
            Metric(f"{on}: outputs identical to plain decoding", same / len(outs) * 100, "%"),
        ]
        if stats.num_drafts:
            metrics.append(
                Metric(f"{on}: mean acceptance length", stats.mean_acceptance_length, "tokens")
            )
    if speculative["method"] == "ngram":
        metrics += ngram_lookup_metrics(speculative)
    bench = {"shape": args.shape, "num_layers": args.num_layers, "batch": args.batch}
    return bench | {
        "max_tokens": args.max_tokens,
        "speculative_config": json.dumps(speculative),
    }, metrics


def ngram_lookup_metrics(speculative: dict[str, Any]) -> list[Metric]:
    """µs per n-gram lookup over text-like sequences (a few hundred distinct tokens, with
    repeats), each of 50 requests' lookups as it grows by one token, after its first."""
    k = speculative["num_speculative_tokens"]
    proposer = NgramProposer(
        k, speculative.get("prompt_lookup_min", 1), speculative.get("prompt_lookup_max", 4)
    )
    rng = np.random.default_rng(0)
    out = []
    for n in (256, 1024, 4096):
        seqs = [rng.integers(0, 300, n + 1).tolist() for _ in range(50)]
        for i, seq in enumerate(seqs):
            proposer.lookup(str(i), seq[:n], k)
        start = time.perf_counter()
        for i, seq in enumerate(seqs):
            proposer.lookup(str(i), seq, k)
        out.append(
            Metric(
                f"n-gram lookup over {n} tokens",
                (time.perf_counter() - start) / len(seqs) * 1e6,
                "µs",
            )
        )
    return out
