"""``heron bench image``: image+text requests against text-only ones of the same token counts.

``--requests`` requests (8), submitted at once, each ``--text-len`` random tokens (64) and one
``--image-size`` square random image (448: 784 patches of 16 pixels, 196 placeholder tokens
after the 2x2 merge), answered with ``--output-len`` tokens (32), greedy, EOS ignored; every
image differs (no encoder-cache or prefix-cache hits). Then the same prompt lengths in random
text tokens alone. Figures: the vision tower's ms per image (one image a pass, after a warm-up),
the mean TTFT and the output throughput of both runs. Default shape: qwen3.5-0.8b with its
vision tower (dummy weights).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import numpy as np
import torch

from heron import LLM
from heron.bench import engines
from heron.bench.result import Metric
from heron.bench.shapes import with_vision
from heron.config import EngineConfig

REQUESTS, TEXT_LEN, IMAGE_SIZE, OUTPUT_LEN, ENCODER_REPEATS = 8, 64, 448, 32, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--text-len", type=int, default=TEXT_LEN, help="text tokens a prompt")
    parser.add_argument("--image-size", type=int, default=IMAGE_SIZE, help="image side, pixels")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="tokens an answer")


def timed_run(llm: LLM, prompts: list[Any], output_len: int) -> tuple[float, float]:
    """Mean TTFT (s) and output tokens/s of ``prompts`` submitted at once."""
    params = engines.greedy(output_len)
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, params)
    start, first, tokens = time.perf_counter(), {}, 0
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.outputs[0].token_ids:
                first.setdefault(output.request_id, time.perf_counter() - start)
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
    return statistics.mean(first.values()), tokens / (time.perf_counter() - start)


def encoder_ms(llm: LLM, prompt: dict) -> float:
    """The vision tower's ms for one image (after a warm-up pass)."""
    _, _, items = llm._multimodal_prompt(prompt)
    model, device = llm.engine.runner.model, llm.engine.runner.device
    times = []
    with torch.inference_mode():
        for _ in range(ENCODER_REPEATS + 1):
            start = time.perf_counter()
            model.encode(items)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def run(args: argparse.Namespace, config: EngineConfig) -> tuple[dict[str, Any], list[Metric]]:
    from PIL import Image

    if min(args.requests, args.text_len, args.image_size, args.output_len) < 1:
        raise ValueError("--requests, --text-len, --image-size and --output-len must be >= 1")
    if args.shape is None and config.model is None:
        args.shape = "qwen3.5-0.8b"
    shape = engines.resolve_shape(args, config)
    if shape is not None:
        shape = with_vision(shape)
    rng, pixels = random.Random(0), np.random.RandomState(0)
    on = engines.label(args, config)
    # (a shape's 32-pixel merged patches; a --model keeps its own context length)
    tokens = args.text_len + (args.image_size // 32 + 2) ** 2 + args.output_len
    options = {} if shape is None else {"max_model_len": tokens}
    with engines.open_llm(shape, config, **options) as llm:
        top = min(10000, llm.engine.model_config.vocab_size - 1)
        image_token = llm.engine.model_config.hf_config.image_token_id
        prompts = []
        for _ in range(args.requests):
            side = args.image_size
            image = Image.fromarray(pixels.randint(0, 256, (side, side, 3), dtype=np.uint8))
            ids = [rng.randint(2, top) for _ in range(args.text_len)] + [image_token]
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": image}})
        lengths = [len(llm._multimodal_prompt(p)[1]) for p in prompts]
        text_only = [[rng.randint(2, top) for _ in range(n)] for n in lengths]
        per_image = encoder_ms(llm, prompts[0])
        timed_run(llm, text_only[:1], 2)  # (warm-up)
        image_ttft, image_tps = timed_run(llm, prompts, args.output_len)
        text_ttft, text_tps = timed_run(llm, text_only, args.output_len)
    note = f"{args.requests} requests of {lengths[0]} prompt tokens, {args.output_len} out"
    metrics = [
        Metric(f"{on}: encoder per {args.image_size}px image", per_image, "ms"),
        Metric(f"{on}: image+text mean TTFT", image_ttft * 1e3, "ms", note=note),
        Metric(f"{on}: text-only mean TTFT", text_ttft * 1e3, "ms", note=note),
        Metric(f"{on}: image+text output throughput", image_tps, "tok/s", note=note),
        Metric(f"{on}: text-only output throughput", text_tps, "tok/s", note=note),
    ]
    keys = ("requests", "text_len", "image_size", "output_len")
    return {"shape": args.shape, "num_layers": args.num_layers} | {
        k: getattr(args, k) for k in keys
    }, metrics
