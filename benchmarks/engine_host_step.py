"""Host time of a whole engine decode step (CPU): everything but the model.

A Gemma-3-1B-shaped model (26 layers, five 512-token sliding-window layers then one full layer:
two KV cache groups, a 262,144-token vocabulary) is built tiny (hidden size 32) and its forward,
logits and sampling are replaced by stubs that draw random tokens over the whole vocabulary.
``--batch`` requests of ``--context`` prompt tokens are added (the stub makes prefill free), and
after ten warm-up steps the median and the mean time of ``LLMEngine.step`` are printed:
scheduling, the KV cache, step inputs, detokenisation, stop checks and (streamed) outputs. The
mean is what a decode benchmark's ms per step sees; it is higher because requests that cross a
block boundary take the KV cache's slow path (all at once here: the prompts have one length).

    python benchmarks/engine_host_step.py [--batch 64] [--context 4096] [--vocab 262144]
        [--block-size 64] [--steps 100] [--no-stream] [--profile]

The KV cache blocks are CUDA's default size (64 tokens) unless ``--block-size`` says otherwise;
the CPU's own default is 16.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from heron import LLM, SamplingParams
from heron.platforms import CudaPlatform

from gemma_decode import GEMMA3_1B
from gpu_decode import save_random_checkpoint


def build_engine(
    path: Path, vocab: int, max_model_len: int, block_size: int = CudaPlatform.default_block_size
) -> LLM:
    import transformers as tf

    # Gemma-3-1B's layers, heads, window and tied embeddings, with tiny matrices.
    config = tf.Gemma3TextConfig(
        **dict(
            GEMMA3_1B,
            hidden_size=32,
            head_dim=16,
            intermediate_size=32,
            vocab_size=vocab,
            max_position_embeddings=max_model_len,
        )
    )
    torch.manual_seed(0)
    save_random_checkpoint(tf.Gemma3ForCausalLM(config), path)
    llm = LLM(
        str(path),
        max_model_len=max_model_len,
        block_size=block_size,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=1 << 20,
    )
    runner = llm.engine.runner
    draws = torch.Generator().manual_seed(0)
    runner.model.forward = lambda token_ids: torch.zeros(token_ids.shape[0], 8)
    runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 8)
    runner.plan.build_views = lambda seq: None
    runner.sampler.sample_on_device = lambda logits, requests, generator, bitmask=None: (
        torch.randint(vocab, (logits.shape[0],), generator=draws)
    )
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument(
        "--block-size",
        type=int,
        default=CudaPlatform.default_block_size,
        help="tokens per KV cache block (default: CUDA's)",
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--no-stream", action="store_true", help="outputs only when finished")
    parser.add_argument("--profile", action="store_true", help="cProfile of the timed steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_engine(Path(tmp), args.vocab, args.context + args.steps + 64, args.block_size)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [3 + i] * args.context, params, stream=not args.no_stream)
    for _ in range(10):
        engine.step()
    profiler = cProfile.Profile() if args.profile else None
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        times.append(time.perf_counter() - start)
    print(
        f"batch {args.batch}, context {args.context}, vocab {args.vocab}, "
        f"blocks of {args.block_size}: "
        f"{statistics.median(times) * 1e6:.0f} µs per step (median of {args.steps}), mean "
        f"{statistics.mean(times) * 1e6:.0f} µs"
    )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
