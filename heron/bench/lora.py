"""``heron bench lora``: decode steps and workload A with LoRA adapters in the batch, against
the base model.

Each decode case is ``heron bench decode``'s (``batch`` requests of ``context`` prompt tokens
decoding greedily; ms per step while all decode), with ``k`` distinct adapters given to the
requests in turn, for each ``k`` of ``--adapters``: 0 runs on an engine without LoRA (the base
model), the others on one with ``enable_lora`` (``max_loras`` the largest ``k``). The adapters
are random rank-``--lora-rank`` adapters in PEFT's format over every attention and MLP
projection (attention only for an MoE shape), written for the run. ``--throughput`` adds
workload A (``heron bench throughput``'s, shrunk by its flags) with the largest ``k``'s
adapters in turn, and without. A step's floor is the base model's (``heron bench decode``'s)
and the adapters it uses read once each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from heron import LoRARequest
from heron.bench import engines, throughput
from heron.bench.decode import (
    CPU_CONTEXT,
    CPU_NEW_TOKENS,
    GPU_CONTEXT,
    GPU_NEW_TOKENS,
    floor_bytes,
    prompts,
)
from heron.bench.measure import copy_bandwidth, has_experts, median_of
from heron.bench.result import Metric
from heron.bench.shapes import Shape
from heron.config import EngineConfig
from heron.platforms import resolve_device

#: The adapters' rank unless ``--lora-rank`` says otherwise (case names say any other).
DEFAULT_RANK = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="requests at once")
    parser.add_argument(
        "--adapters", type=int, nargs="+", default=[0, 1, 8],
        help="distinct adapters in the batch (0: the base model, LoRA off)",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=DEFAULT_RANK, help="the adapters' rank")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated per request")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs of every case, in turn; the median"
    )
    parser.add_argument("--throughput", action="store_true", help="also workload A")
    throughput.add_arguments(parser)


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    shape = engines.resolve_shape(args, config)
    if shape is None:
        raise ValueError("heron bench lora writes adapters for a --shape")
    device = resolve_device(config.device)
    on_gpu = device.type == "cuda"
    context = args.context or (GPU_CONTEXT if on_gpu else CPU_CONTEXT)
    new = args.new_tokens or (GPU_NEW_TOKENS if on_gpu else CPU_NEW_TOKENS)
    most = max(args.adapters)
    lora_config = dataclasses.replace(
        config, enable_lora=True, max_loras=max(most, 1), max_lora_rank=args.lora_rank
    )
    on = engines.label(args, config)
    # The floor: the base model's step and the adapters in use once each (an MoE shape's
    # experts touched are not counted here: no floor).
    bandwidth = copy_bandwidth(device) if on_gpu and not has_experts(shape) else None
    metrics: list[Metric] = []
    with tempfile.TemporaryDirectory(prefix="heron-bench-lora-") as tmp:
        loras = write_adapters(shape, most, args.lora_rank, Path(tmp))
        options = dict(max_model_len=context + new + 16)
        for k in sorted(set(args.adapters)):
            with engines.open_llm(shape, lora_config if k else config, **options) as llm:
                for b in args.batch:
                    given = [loras[i % k] for i in range(b)] if k else None
                    llm.generate(prompts(context, b), engines.greedy(4), use_tqdm=False)
                    runs = [
                        engines.timed_decode(llm, prompts(context, b), new, given)
                        for _ in range(args.repeats)
                    ]
                    ms, ms_spread = median_of([ms for ms, _ in runs])
                    tps, tps_spread = median_of([tps for _, tps in runs])
                    adapters = _adapters(k, args.lora_rank, lora_config.max_loras)
                    case = f"{on}, {adapters}, context {context}, batch {b}"
                    floor = None
                    if bandwidth is not None:
                        nbytes = floor_bytes(shape, config, b, context + new / 2)
                        nbytes += min(k, b) * adapter_bytes(shape, args.lora_rank)
                        floor = nbytes / bandwidth * 1e3
                    metrics.append(Metric(f"{case}: ms/step", ms, "ms", floor, ms_spread))
                    metrics.append(Metric(f"{case}: output tok/s", tps, "tok/s", note=tps_spread))
        if args.throughput:
            metrics += _workload_a(args, shape, config, lora_config, loras, on)
    settings = {"shape": args.shape, "num_layers": args.num_layers, "lora_rank": args.lora_rank}
    cases = {"adapters": args.adapters, "context": context, "new_tokens": new}
    return settings | cases | {"repeats": args.repeats}, metrics


def _adapters(k: int, rank: int, slots: int) -> str:
    """The case's name: ``k`` adapters (their rank where it is not ``DEFAULT_RANK``) in the
    engine's ``slots`` (its ``max_loras``), which the LoRA kernels' work grows with whether or
    not a step uses them all."""
    if k == 0:
        return "base model"
    of_rank = f" of rank {rank}" if rank != DEFAULT_RANK else ""
    return f"{k} adapter{'s' * (k > 1)}{of_rank} in {slots} slot{'s' * (slots > 1)}"


def _workload_a(args, shape, config, lora_config, loras, on) -> list[Metric]:
    sizes = (args.num_seqs, args.max_input_len, args.max_output_len)
    prompts_a, params = throughput.workload(*sizes, args.workload_seed, args.min_len)
    max_model_len = args.max_input_len + args.max_output_len
    metrics = []
    for k in (0, len(loras)):
        given = [loras[i % k] for i in range(len(prompts_a))] if k else None
        with engines.open_llm(
            shape, lora_config if k else config, max_model_len=max_model_len
        ) as llm:
            llm.generate(prompts_a[:8], engines.greedy(8), use_tqdm=False)
            seconds, generated = throughput.timed_generate(llm, prompts_a, params, given)
        metrics.append(
            Metric(
                f"{on}, {_adapters(k, args.lora_rank, lora_config.max_loras)}: "
                "workload A output tok/s",
                generated / seconds,
                "tok/s",
            )
        )
    return metrics


def _projections(shape: Shape) -> dict[str, tuple[int, int]]:
    """The projections an adapter of ``shape`` updates, by PEFT's module name: (in, out)."""
    if shape.family not in ("dense", "moe"):
        raise ValueError(
            f"heron bench lora writes adapters of Llama-like shapes, not {shape.family}"
        )
    f = shape.fields
    hidden, heads = f["hidden_size"], f["num_attention_heads"]
    head_dim = f.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, f.get("num_key_value_heads", heads) * head_dim
    projections = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
    }
    if not has_experts(shape):
        inter = f["intermediate_size"]
        projections |= {
            "mlp.gate_proj": (hidden, inter),
            "mlp.up_proj": (hidden, inter),
            "mlp.down_proj": (inter, hidden),
        }
    return projections


def adapter_bytes(shape: Shape, rank: int) -> int:
    """The bytes of one rank-``rank`` adapter's A and B over every layer, in bf16."""
    columns = sum(k + n for k, n in _projections(shape).values())
    return 2 * rank * columns * shape.fields["num_hidden_layers"]


def write_adapters(shape: Shape, count: int, rank: int, root: Path) -> list[LoRARequest]:
    """``count`` random rank-``rank`` PEFT adapters of ``shape``'s projections under ``root``."""
    projections = _projections(shape)
    targets = sorted({name.rpartition(".")[2] for name in projections})
    generator = torch.Generator().manual_seed(0)
    loras = []
    for i in range(count):
        path = root / f"adapter-{i}"
        path.mkdir()
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
        (path / "adapter_config.json").write_text(json.dumps(config))
        tensors = {}
        for layer in range(shape.fields["num_hidden_layers"]):
            for name, (k, n) in projections.items():
                key = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=generator) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=generator) * 0.01
        save_file(tensors, path / "adapter_model.safetensors")
        loras.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
    return loras
