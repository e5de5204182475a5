"""Two source trees of Heron measured alike, alternating, through the public API alone.

An internal redesign changes the harness's own imports (``heron bench`` of today does not run
on a tree from before it), so this script measures any tree the same way: each run is a fresh
process on one tree (``PYTHONPATH``) that builds an ``LLM`` over a dummy-weight checkpoint of a
shape and runs the cases it is given, using nothing but ``LLM``, ``SamplingParams``,
``generate`` and the step loop (``add_request``/``step``, on the ``LLM`` or, in older trees, on
its engine). This process makes the checkpoints and the prompts and computes the figures with
``heron.bench`` (decode: ms per step while every request decodes; workload A: output tok/s).
Trees alternate per round, so drift of the machine shows as a spread, not as a difference.

    python benchmarks/ab_trees.py --tree before=../old --tree after=. \\
        --shape qwen3-0.6b --shape gemma-3-1b --rounds 2 --output-json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Per shape: the context of its decode cases (Gemma's at 4k, as its published figures are).
CONTEXTS = {"qwen3-0.6b": 128, "gemma-3-1b": 4096}
BATCHES, DECODE_TOKENS, WARM_TOKENS = (1, 64), 128, 16


def worker(plan_path: str) -> None:
    """Runs one plan on the tree on ``PYTHONPATH``; prints its raw timings as one JSON line."""
    from heron import LLM, SamplingParams

    plan = json.loads(Path(plan_path).read_text())
    llm = LLM(
        plan["model"], load_format="dummy", dtype="bfloat16", max_model_len=plan["max_model_len"]
    )
    stepper = llm if hasattr(llm, "step") else llm.engine
    results = []
    for case in plan["cases"]:
        params = [
            SamplingParams(temperature=case["temperature"], max_tokens=n, ignore_eos=True)
            for n in case["max_tokens"]
        ]
        if case["kind"] == "generate":
            start = time.perf_counter()
            outs = llm.generate(case["prompts"], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results.append({"seconds": seconds, "tokens": tokens})
            continue
        for i, (prompt, p) in enumerate(zip(case["prompts"], params)):
            stepper.add_request(f"ab-{len(results)}-{i}", prompt, p)
        times: dict[str, list[float]] = {}
        while stepper.has_unfinished_requests():
            outputs = stepper.step()
            now = time.perf_counter()
            for o in outputs:
                got = times.setdefault(o.request_id, [])
                got.extend([now] * (len(o.outputs[0].token_ids) - len(got)))
        results.append({"token_times": list(times.values())})
    print("RESULT " + json.dumps(results), flush=True)


def cases(shape: str, num_seqs: int) -> tuple[list[dict], list[str | None]]:
    """The plan's cases and the names of those that are timed (warm-ups are not); workload A
    of ``num_seqs`` requests."""
    from heron.bench.throughput import workload

    rng = random.Random(0)
    context = CONTEXTS[shape]

    def decode(batch: int, tokens: int) -> dict:
        prompts = [[rng.randrange(2, 10000) for _ in range(context)] for _ in range(batch)]
        return dict(kind="decode", prompts=prompts, max_tokens=[tokens] * batch, temperature=0)

    def generate(seed: int, cap: int | None) -> dict:
        prompts, params = workload(num_seqs, seed=seed)
        lengths = [p.max_tokens if cap is None else min(p.max_tokens, cap) for p in params]
        return dict(kind="generate", prompts=prompts, max_tokens=lengths, temperature=0.6)

    plan = [generate(1, 32)] + [decode(b, WARM_TOKENS) for b in BATCHES]
    names = [None] * len(plan)
    for b in BATCHES:
        plan.append(decode(b, DECODE_TOKENS))
        names.append(f"{shape}, context {context}, batch {b}: ms/step")
    plan.append(generate(0, None))
    names.append(f"{shape}: workload A output tok/s")
    return plan, names


def figure(result: dict) -> float:
    from heron.bench.measure import steady_decode_ms

    if "seconds" in result:
        return result["tokens"] / result["seconds"]
    return steady_decode_ms(result["token_times"])


def run_tree(tree: Path, plan_path: Path) -> list[dict]:
    env = os.environ | {"PYTHONPATH": str(tree.resolve())}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(plan_path)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="PLAN", help=argparse.SUPPRESS)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--shape", action="append", choices=sorted(CONTEXTS), default=[])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-layers", type=int, help="fewer layers (a check on the CPU)")
    parser.add_argument("--num-seqs", type=int, default=256, help="workload A's requests")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from heron.bench.shapes import shape, write_checkpoint

    trees = dict(t.split("=", 1) for t in args.tree)
    table: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shape:
            model = Path(tmp, name)
            write_checkpoint(shape(name, args.num_layers), model)
            plan, names = cases(name, args.num_seqs)
            plan_path = Path(tmp, f"{name}.json")
            max_len = CONTEXTS[name] + 2048
            plan_path.write_text(
                json.dumps(dict(model=str(model), max_model_len=max_len, cases=plan))
            )
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    for metric, result in zip(names, run_tree(Path(tree), plan_path)):
                        if metric is not None:
                            table.setdefault(metric, {}).setdefault(label, []).append(
                                figure(result)
                            )
    labels = list(trees)
    print("| figure | " + " | ".join(f"{lab} (each round)" for lab in labels) + " | ratio |")
    print("| --- " * (len(labels) + 2) + "|")
    for metric, by_tree in table.items():
        cells = [" / ".join(f"{v:,.4g}" for v in by_tree[lab]) for lab in labels]
        ratio = statistics.mean(by_tree[labels[-1]]) / statistics.mean(by_tree[labels[0]])
        print(f"| {metric} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    if args.output_json:
        args.output_json.write_text(json.dumps({"trees": trees, "figures": table}, indent=1))


if __name__ == "__main__":
    main()
