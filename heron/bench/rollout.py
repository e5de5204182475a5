"""``heron bench rollout``: what an RL step pays beside generation. The ``--shape`` (default
qwen3-0.6b) with random weights saved as a checkpoint runs in sleep mode; each of
``--repeats`` rounds (the median is reported) times sleep and wake-up at level 1, then level 2
with its two wake-up tags, a full weight update from tensors in host memory (the
checkpoint's, all of them) and a reload of the checkpoint from disk. On CUDA it also reports
the device memory given back while asleep at level 2, as a share of what the engine's
allocator held before (CUDA's own context stays).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from heron.bench import engines
from heron.bench.measure import synchronize
from heron.bench.result import Metric
from heron.bench.shapes import Shape, write_checkpoint
from heron.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported")


def save_random_checkpoint(shape: Shape, path: Path, dtype: torch.dtype) -> None:
    """``shape``'s config, tokenizer and random weights (HF's init, in ``dtype``) at ``path``."""
    import transformers as tf

    write_checkpoint(shape, path)
    config = tf.AutoConfig.from_pretrained(path)
    tf.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    shape = engines.resolve_shape(args, config)
    if shape is None:
        raise ValueError("heron bench rollout runs a --shape (its checkpoint is written here)")
    from safetensors.torch import load_file

    on = engines.label(args, config)
    dtype = getattr(torch, config.dtype) if config.dtype != "auto" else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_random_checkpoint(shape, path, dtype)
        tensors = [
            (n, t) for f in sorted(path.glob("*.safetensors")) for n, t in load_file(f).items()
        ]
        engine_config = dataclasses.replace(config, model=str(path), enable_sleep_mode=True)
        with engines.open_llm(None, engine_config, max_model_len=1024) as llm:
            llm.generate([[2, 3, 4, 5]], engines.greedy(4), use_tqdm=False)  # (warm)
            device = llm.engine.runner.device
            runs: dict[str, list[float]] = {}

            def timed(name: str, call: Callable[[], object]) -> None:
                synchronize(device)
                start = time.perf_counter()
                call()
                synchronize(device)
                runs.setdefault(name, []).append((time.perf_counter() - start) * 1e3)

            freed = []
            for _ in range(args.repeats):
                timed("sleep, level 1", lambda: llm.sleep(level=1))
                timed("wake up, level 1", llm.wake_up)
                held = _held(device)
                timed("sleep, level 2", lambda: llm.sleep(level=2))
                freed.append(_freed_share(device, held))
                timed("wake up weights, level 2", lambda: llm.wake_up(["weights"]))
                timed("wake up kv_cache, level 2", lambda: llm.wake_up(["kv_cache"]))
                timed(
                    f"update_weights, {len(tensors)} tensors", lambda: llm.update_weights(tensors)
                )
                timed("reload_weights from disk", llm.reload_weights)
    metrics = [Metric(f"{on}: {name}", statistics.median(ms), "ms") for name, ms in runs.items()]
    if device.type == "cuda":
        note = "of the memory the allocator held"
        metrics.append(
            Metric(f"{on}: device memory freed asleep, level 2", min(freed), "%", note=note)
        )
    return {
        "shape": args.shape or "qwen3-0.6b",
        "num_layers": args.num_layers,
        "repeats": args.repeats,
    }, metrics


def _held(device: torch.device) -> tuple[int, int]:
    """(free device bytes, bytes the allocator holds) before a sleep."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)


def _freed_share(device: torch.device, before: tuple[int, int]) -> float:
    """Percent of what the allocator held that is free on the device now."""
    if device.type != "cuda":
        return 0.0
    free, held = before
    return 100.0 * (torch.cuda.mem_get_info(device)[0] - free) / held
