"""What structured outputs cost: grammar compilation, and decode throughput with grammar rows.

On the default model (or ``--model``), prints a markdown table of:

  compile   ms to compile a JSON schema the first time (tokenizer info included) and again
            (the cache), measured as the time until a one-token request returns
  decode    output tokens/s of ``--batch`` requests of up to ``--max-tokens`` tokens each, free
            and with every row under a JSON schema, then with half the rows under it (a step
            with grammar rows waits for the previous step's tokens before its mask is filled)

    PYTHONPATH=$PWD python benchmarks/structured_outputs.py [--model PATH] [--batch 64]
        [--max-tokens 128]
"""

from __future__ import annotations

import argparse

from heron import LLM, SamplingParams
from heron.bench.throughput import timed_generate
from heron.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "city", "hobbies", "address"],
}
PROMPT = "Write a JSON record of a fictional person with name, age, city, hobbies and address:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default=None, help="default: Heron's default model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(args.model)
    constrained = StructuredOutputsParams(json=SCHEMA)

    def params(grammar: bool, seed: int, max_tokens: int = args.max_tokens) -> SamplingParams:
        return SamplingParams(
            temperature=0.8,
            seed=seed,
            max_tokens=max_tokens,
            structured_outputs=constrained if grammar else None,
        )

    rows = ["| measure | value |", "|---|---|"]
    for label in ("compile, first (ms)", "compile, cached (ms)"):
        seconds, _ = timed_generate(llm, [PROMPT], [params(True, 0, max_tokens=1)])
        rows.append(f"| {label} | {seconds * 1e3:.1f} |")
    timed_generate(llm, [PROMPT] * 8, [params(False, i) for i in range(8)])  # warm-up
    prompts = [PROMPT] * args.batch
    for label, grammar_rows in (("free", 0), ("all rows JSON", args.batch), ("half JSON", None)):
        count = args.batch // 2 if grammar_rows is None else grammar_rows
        seconds, tokens = timed_generate(
            llm, prompts, [params(i < count, i) for i in range(args.batch)]
        )
        rows.append(f"| decode {label}, batch {args.batch} (tok/s) | {tokens / seconds:.0f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
