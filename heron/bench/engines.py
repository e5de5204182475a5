"""The engine a benchmark runs: a named shape's random-weight checkpoint, or a given model,
with the engine flags of the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from heron import LLM, LoRARequest, SamplingParams
from heron.bench.measure import steady_decode_ms
from heron.bench.shapes import Shape, dummy_checkpoint, shape
from heron.config import EngineConfig


def resolve_shape(
    args: Any, config: EngineConfig, default: str | None = "qwen3-0.6b"
) -> Shape | None:
    """``--shape``'s shape (``--num-layers`` applied, ``--mtp`` where asked), or ``default``'s;
    None where ``--model`` names a checkpoint instead (or neither is given and ``default`` is
    None: the default model)."""
    if config.model is not None and args.shape is not None:
        raise ValueError(
            f"give --shape or --model, not both (--shape {args.shape}, --model {config.model})"
        )
    name = args.shape or (None if config.model is not None else default)
    if name is None and getattr(args, "weight_format", None):
        raise ValueError("--weight-format packs a --shape's random weights, not a --model's")
    if name is None:
        if args.num_layers is not None:
            raise ValueError("--num-layers shortens a --shape, not a --model")
        return None
    return shape(
        name, args.num_layers, getattr(args, "mtp", False), getattr(args, "weight_format", None)
    )


def label(args: Any, config: EngineConfig) -> str:
    """What a figure was measured on, for its name: the shape or model, and the switches
    that change its bytes or its path (the rest is in the result's configuration)."""
    name = args.shape or (Path(config.model).name if config.model else None)
    if name is None:
        name = "default model" if getattr(args, "bench_command", "") == "spec" else "qwen3-0.6b"
    switches = [
        f"{args.num_layers} layer{'s' * (args.num_layers > 1)}" if args.num_layers else "",
        "FP8 weights" if config.quantization else "",
        _weight_format_label(getattr(args, "weight_format", None)),
        "FP8 KV cache" if config.kv_cache_dtype == "fp8" else "",
        f"tensor parallel {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else "",
        "eager" if config.enforce_eager else "",
    ]
    switches = [s for s in switches if s]
    return name + (f" ({', '.join(switches)})" if switches else "")


@contextlib.contextmanager
def open_llm(shape: Shape | None, config: EngineConfig, **options: Any) -> Iterator[LLM]:
    """An ``LLM`` of ``config`` with ``options`` for the fields the user left unset (None),
    over ``shape``'s dummy checkpoint where given; shut down and its memory freed at exit."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    with contextlib.ExitStack() as stack:
        if shape is not None:
            fields["model"] = stack.enter_context(dummy_checkpoint(shape))
            fields["load_format"] = "dummy"
        llm = LLM(**(options | fields))
        try:
            yield llm
        finally:
            llm.shutdown()  # (drops the engine: the caller's name for ``llm`` outlives this)
            del llm
            free_device_memory()


def free_device_memory() -> None:
    """After an engine is dropped: its reference cycles hold device memory until collected."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def timed_decode(
    llm: LLM,
    prompts: list[list[int]],
    new_tokens: int,
    loras: Sequence[LoRARequest | None] | None = None,
) -> tuple[float, float]:
    """(ms per decode step while all requests decode, output tokens/s) of ``prompts`` each
    generating ``new_tokens`` greedily (under ``loras``' adapters, one each), with per-token
    times as the caller of ``LLM.step`` sees them (a step's outputs are on the host when it
    returns)."""
    for i, prompt in enumerate(prompts):
        lora = loras[i] if loras else None
        llm.add_request(f"bench-{i}", prompt, greedy(new_tokens), lora_request=lora)
    times: dict[str, list[float]] = {}
    seen: dict[str, int] = {}
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        outputs = llm.step()
        now = time.perf_counter()
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            times.setdefault(o.request_id, []).extend([now] * (n - seen.get(o.request_id, 0)))
            seen[o.request_id] = n
    wall = time.perf_counter() - start
    return steady_decode_ms(list(times.values())), len(prompts) * new_tokens / wall


def local_model(llm: LLM) -> torch.nn.Module:
    """The model of the engine's process (rank 0's under tensor parallelism)."""
    runner = llm.engine.runner
    return getattr(runner, "local", runner).model


def touched_experts(llm: LLM, prompts: list[list[int]], steps: int = 8) -> list[int]:
    """Distinct experts of each MoE layer in each decode step of ``prompts`` (steps over
    exactly one token a request), from hooks on the routers of an eager engine (replayed
    graphs skip hooks; every rank routes alike)."""
    from heron.layers.routing import TopKRouter

    if llm.engine.runner.graphs is not None:
        raise ValueError("count experts on an engine built with enforce_eager=True")
    batch, counts = len(prompts), []

    def hook(module, inputs, output):
        if output[1].shape[0] == batch:
            counts.append(output[1].unique().numel())

    modules = [m for m in local_model(llm).modules() if isinstance(m, TopKRouter)]
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        llm.generate(prompts, greedy(steps), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return counts


def _weight_format_label(weight_format: str | None) -> str:
    if weight_format is None:
        return ""
    return "mxfp4 experts" if weight_format == "mxfp4" else f"{weight_format} W4A16 weights"
