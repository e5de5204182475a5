"""The ``heron bench`` subcommands' arguments, and running one (imports no torch until run)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import asdict

from heron.config import EngineConfig

# subcommand: (module, help, whether it takes the engine flags and --shape)
SUBCOMMANDS = {
    "decode": ("decode", "ms per decode step at given batches and contexts, x the floor", True),
    "throughput": ("throughput", "workload A (nano-vllm's bench.py): output tokens/s", True),
    "serve": ("serve", "a concurrency curve of streaming completions against heron serve", False),
    "spec": ("spec", "speculative decoding against plain decoding", True),
    "embed": ("embed", "embedding throughput of a pooling model: inputs/s and tokens/s", True),
    "lora": ("lora", "decode and throughput with LoRA adapters in the batch", True),
    "turns": ("turns", "multi-turn conversations: prompt tokens computed and TTFT per turn", True),
    "offload": (
        "offload",
        "a working set beyond the device pool, with and without the host-memory tier",
        True,
    ),
    "image": ("image", "image+text requests against text-only ones: encoder ms, TTFT, tok/s", True),
    "kernel": ("kernel", "one decode kernel alone, x its bandwidth floor", False),
    "host": ("host", "host time of an engine step with the model stubbed out (CPU)", False),
    "profile": ("profile", "where a decode step's time goes (torch.profiler or cProfile)", True),
    "rollout": ("rollout", "sleep, wake-up and weight update times (RL rollouts)", True),
}


def add_bench_parser(
    parser: argparse.ArgumentParser, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    """``parser``'s subcommands, those that build an engine with ``add_engine_args``' flags."""
    from heron.bench.shapes import SHAPES, WEIGHT_FORMATS

    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    for name, (module, help_text, builds_engine) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=_doc(module))
        p.add_argument("--output-json", metavar="PATH", help="write the result here as JSON")
        p.add_argument(
            "--commit", default=None,
            help="the source tree's commit, where git cannot tell (a copy without .git)",
        )  # fmt: skip
        if builds_engine:
            p.add_argument(
                "--shape", choices=sorted(SHAPES), default=None,
                help="random-weight model shape (default: qwen3-0.6b unless --model is given)",
            )  # fmt: skip
            p.add_argument(
                "--num-layers", type=int, default=None,
                help="the shape with this many decoder layers (a short model for the CPU)",
            )  # fmt: skip
            p.add_argument(
                "--weight-format", choices=sorted(WEIGHT_FORMATS), default=None,
                help="the --shape's weights packed as this checkpoint format's int4 (W4A16, "
                "groups of 128), or (mxfp4) its experts as gpt-oss's MXFP4",
            )  # fmt: skip
            add_engine_args(p)
        _module(module).add_arguments(p)


def _module(name: str):
    return importlib.import_module(f"heron.bench.{name}")


def _doc(module: str) -> str:
    return (_module(module).__doc__ or "").strip()


def run(
    args: argparse.Namespace, config: EngineConfig | None, argv: list[str] | None = None
) -> int:
    """Run the subcommand; print its figures, and write them to ``--output-json``."""
    from heron.bench import result

    module, _, builds_engine = SUBCOMMANDS[args.bench_command]
    bench_config, metrics = _module(module).run(args, config)
    device = "cpu"
    if builds_engine:
        from heron.platforms import resolve_device

        device = str(resolve_device(config.device))
        bench_config = {"engine": _plain(asdict(config)), **bench_config}
    elif args.bench_command in ("kernel", "serve"):
        import torch

        # a server started here runs on this machine's GPU (with --base-url: where it runs)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    for metric in metrics:
        print(metric.describe())
    if args.output_json:
        result.write(
            args.output_json,
            result.result(args.bench_command, device, bench_config, metrics, argv, args.commit),
        )
    return 0


def _plain(values: dict) -> dict:
    return {
        k: v if isinstance(v, (bool, int, float, str, type(None), dict, list)) else str(v)
        for k, v in values.items()
    }
