"""Heron against HF transformers' continuous batching on a Qwen3-0.6B-shaped model (GPU).

Builds a random-weight model with Qwen3-0.6B's shape (bf16, tied embeddings), saves it in HF
format and measures, in one run:

  A  throughput: 256 requests, input and output lengths uniform in [100, 1024] (seed 0)
  B  batch 1, 128-token prompt, 256 output tokens: decode ms per step, and its multiple of the
     bandwidth floor (weight bytes + KV bytes read per step) / measured copy bandwidth
  C  batch 64, 128-token prompts, 256 output tokens: decode ms per step and tokens/s
  D  host time per decode step that the GPU sits idle (graphs on)

B and C are measured as the caller sees them: per request (time of last token - time of first
token) / (tokens - 1), averaged over requests. Prints a markdown table.

    python benchmarks/gpu_decode.py [--skip-hf] [--hf-requests 32] [--load-format dummy]
        [--quantization fp8] [--kv-cache-dtype fp8] [--tensor-parallel-size 2] [--breakdown]

``--load-format dummy`` writes only config.json and the tokenizer: Heron makes random weights
on the GPU, and HF its own random init. ``--quantization fp8`` (FP8 linear weights) and
``--kv-cache-dtype fp8`` apply to Heron only; the floors count their bytes (one per FP8
element; the tied embedding / LM head stays bf16). ``--tensor-parallel-size N`` splits Heron's
model over N GPUs; the floors are then one GPU's share (the bytes over N, collectives not
counted), and HF, on one GPU, is not run.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from heron import LLM, SamplingParams

QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
)


def build_model(path: Path, load_format: str) -> None:
    import transformers as tf

    config = tf.Qwen3Config(**QWEN3_0_6B)
    if load_format == "dummy":
        save_config_only(config, "Qwen3ForCausalLM", path)
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.Qwen3ForCausalLM(config).to(torch.bfloat16)
    save_random_checkpoint(model, path)


def save_random_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Save ``model`` with a trivial word-level tokenizer (prompts are token ids) and no EOS."""
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    save_tokenizer(model.config.vocab_size, path)


def save_config_only(config, architecture: str, path: Path) -> None:
    """What ``--load-format dummy`` needs: config.json and the tokenizer, no weights."""
    config.architectures = [architecture]
    config.save_pretrained(path)
    save_tokenizer(config.vocab_size, path)


def save_tokenizer(vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)


def hf_model(path: Path, load_format: str) -> torch.nn.Module:
    """HF's bf16 model of ``path`` on the GPU; HF's own random init where there are no weights."""
    import transformers as tf

    if load_format == "dummy":
        with torch.device("cuda"):
            config = tf.AutoConfig.from_pretrained(path)
            return tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()


def copy_bandwidth() -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 2 / (start.elapsed_time(end) / 1e3)


def floor_ms(
    batch: int, context: int, bandwidth: float, weight_bytes: int = 2, kv_bytes: int = 2
) -> float:
    """Per-step lower bound: every weight once plus every request's KV history, at full speed
    (``weight_bytes`` per linear-layer element, ``kv_bytes`` per cached element)."""
    c = QWEN3_0_6B
    d, h, kv, hd = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    layers = c["num_hidden_layers"]
    per_layer = d * (h + 2 * kv) * hd + h * hd * d + 3 * d * c["intermediate_size"]
    weights = weight_bytes * layers * per_layer + 2 * c["vocab_size"] * d
    cache = batch * context * layers * 2 * kv * hd * kv_bytes
    return (weights + cache) / bandwidth * 1e3


def add_fp8_args(parser: argparse.ArgumentParser) -> None:
    """Heron's FP8 switches (``EngineConfig.quantization`` and ``kv_cache_dtype``)."""
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")


def element_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """Bytes of one linear-layer weight element and of one cached K/V element."""
    return (1 if args.quantization else 2), (1 if args.kv_cache_dtype == "fp8" else 2)


def print_case_table(
    cases: list[tuple[int, int]], floors: list[float], results: dict[str, list[float | None]]
) -> None:
    """One Markdown row per engine: ms/step and its multiple of the floor per (context, batch)
    (``None``: not run)."""
    header = " | ".join(
        f"ctx {c}, batch {b}: ms/step (× floor {f:.2f} ms)" for (c, b), f in zip(cases, floors)
    )
    print(f"| engine | {header} |")
    print("| --- |" + " --- |" * len(cases))
    for name, times in results.items():
        cells = " | ".join(
            "-" if t is None else f"{t:.3f} ({t / f:.2f}×)" for t, f in zip(times, floors)
        )
        print(f"| {name} | {cells} |")


def steady_decode_ms(token_times: list[list[float]]) -> float:
    """Mean decode time per step while every request decodes, from each request's token times
    (seconds): the window starts when the last request got its first token (before that,
    prefill chunks of the others share the steps) and ends when the first request got its last
    one (after that, the batch shrinks: chunked prefill started the requests steps apart, so
    they finish apart too). Each request's (last - first) / (n - 1) over its tokens in that
    window is averaged."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    per_step = []
    for times in token_times:
        window = [t for t in times if start <= t <= end]
        if len(window) > 1:
            per_step.append((window[-1] - window[0]) / (len(window) - 1))
    if not per_step:
        raise ValueError("no two steps in which every request decodes: generate more tokens")
    return statistics.mean(per_step) * 1e3


def heron_decode_ms(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, float]:
    """(ms per decode step while all requests decode, output tokens/s), with per-token times
    as the caller of ``LLMEngine.step`` sees them."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    times: dict[str, list[float]] = {}
    seen: dict[str, int] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            times.setdefault(o.request_id, []).extend([now] * (n - seen.get(o.request_id, 0)))
            seen[o.request_id] = n
    wall = time.perf_counter() - start
    return steady_decode_ms(list(times.values())), len(prompts) * out_len / wall


def heron_host_idle(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, float]:
    """(ms per decode step, fraction of it the GPU waits for the host), graph-replayed steps.

    CUDA events around each replay (input copy, metadata fill, graph) give the GPU time of a
    step; the caller-side time per step minus that is time the GPU had nothing to do. (Host
    work between the events, the fill, counts as GPU time: a lower bound on the idle time.)
    Only replays with every request in the batch count: chunked prefill starts requests steps
    apart, so they also finish apart, and the replays of the shrinking batch are shorter.
    """
    graphs = llm.engine.runner.graphs
    replay = graphs.run
    events = []

    def timed(seq):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(seq)
        end.record()
        events.append((seq.num_reqs, start, end))
        return out

    graphs.run = timed
    try:
        step_ms, _ = heron_decode_ms(llm, prompts, out_len)
    finally:
        graphs.run = replay
    torch.cuda.synchronize()
    full = [s.elapsed_time(e) for n, s, e in events if n == len(prompts)]
    gpu_ms = statistics.median(full)
    return step_ms, max(0.0, 1 - gpu_ms / step_ms)


def hf_decode_ms(model, prompts: list[list[int]], out_len: int) -> tuple[float, float]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    start = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=cfg, record_timestamps=True)
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return steady_decode_ms([o.timestamps for o in outs.values()]), tokens / wall


def hf_generate_ms(model, prompt: list[int], out_len: int) -> float:
    """Batch-1 decode ms per token through HF's plain ``generate`` (for models its continuous
    batching does not take): ``out_len`` new tokens less one, over ``out_len - 1``."""
    ids = torch.tensor([prompt], device=model.device)
    if "paged" in (model.config._attn_implementation or ""):
        model.set_attn_implementation("sdpa")  # HF's continuous batching left its paged form

    def timed(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)
    return (timed(out_len) - timed(1)) / (out_len - 1) * 1e3


def throughput_workload(
    n: int, seed: int = 0, vocab_size: int = 150000
) -> tuple[list[list[int]], list[int]]:
    """Workload A's prompts (token ids below ``vocab_size``) and output lengths."""
    rng = random.Random(seed)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
    prompts = [[rng.randrange(2, vocab_size) for _ in range(i)] for i, _ in lens]
    return prompts, [o for _, o in lens]


def workload_a(llm: LLM, vocab_size: int = 150000, breakdown: bool = False) -> float:
    """Output tokens/s of workload A (256 requests, in/out uniform in [100, 1024]), after a
    warm-up of the same kind (other prompts, so no prefix-cache hits, and short outputs), so
    that Triton compiles the kernel variants its step shapes need before A is timed (on a
    fresh machine that compilation otherwise falls inside A). ``breakdown`` prints where A's
    time went (:func:`print_steps`)."""
    warm_prompts, warm_outs = throughput_workload(256, 1, vocab_size)
    warm = [
        SamplingParams(temperature=0, max_tokens=min(o, 32), ignore_eos=True) for o in warm_outs
    ]
    llm.generate(warm_prompts, warm, use_tqdm=False)
    prompts, out_lens = throughput_workload(256, 0, vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in out_lens]
    with recorded_steps(llm.engine) if breakdown else contextlib.nullcontext() as steps:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        end = time.perf_counter()
    if breakdown:
        print_steps(steps, end)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (end - start)


@contextlib.contextmanager
def recorded_steps(engine):
    """The steps the engine schedules meanwhile, as (time, requests, tokens)."""
    steps, schedule = [], engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        steps.append((time.perf_counter(), len(out.scheduled), tokens))
        return out

    engine.scheduler.schedule = recording
    try:
        yield steps
    finally:
        del engine.scheduler.schedule  # (the class's method again)


def print_steps(steps: list[tuple[float, int, int]], end: float) -> None:
    """A table of the steps by kind (a prefill step has more tokens than requests) and by
    requests, 32 a bucket: count, seconds, ms per step, tokens. A step lasts until the next one
    is scheduled: with asynchronous scheduling and the GPU the bound, its GPU time."""
    buckets: dict[tuple[str, int], list[float]] = {}
    for (t, rows, tokens), following in zip(steps, [s[0] for s in steps[1:]] + [end]):
        kind = "prefill" if tokens > rows else "decode"
        entry = buckets.setdefault((kind, min(rows // 32 * 32, 256)), [0, 0.0, 0])
        entry[0] += 1
        entry[1] += following - t
        entry[2] += tokens
    print("| steps | count | seconds | ms per step | tokens |")
    print("| --- | --- | --- | --- | --- |")
    for (kind, rows), (count, seconds, tokens) in sorted(buckets.items()):
        print(
            f"| {kind}, {rows}+ requests | {count} | {seconds:.3f} | "
            f"{seconds / count * 1e3:.2f} | {tokens:,} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-requests", type=int, default=32, help="requests of A run by HF")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true", help="where A's time goes, by step")
    add_fp8_args(parser)
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_model(path, args.load_format)
        llm = LLM(
            str(path),
            enforce_eager=args.enforce_eager,
            max_model_len=4096,
            load_format=args.load_format,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        a = workload_a(llm, breakdown=args.breakdown)
        b_ms, _ = heron_decode_ms(llm, [[7] * 128], 256)
        c_ms, c_tps = heron_decode_ms(llm, [[7 + i] * 128 for i in range(64)], 256)
        graphs = llm.engine.runner.graphs
        idle = heron_host_idle(llm, [[5] * 128], 256)[1] if graphs else float("nan")
        rows.append(("Heron", a, b_ms, c_ms, c_tps, idle))
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()

        if not args.skip_hf and args.tensor_parallel_size == 1:  # its floors are per GPU
            model = hf_model(path, args.load_format)
            n = args.hf_requests
            prompts, out_lens = throughput_workload(256)  # A's first n requests
            from transformers import GenerationConfig

            cfg = GenerationConfig(
                max_new_tokens=max(out_lens[:n]), do_sample=False, eos_token_id=None, pad_token_id=0
            )
            start = time.perf_counter()
            res = model.generate_batch(prompts[:n], generation_config=cfg)
            hf_a = sum(len(o.generated_tokens) for o in res.values()) / (
                time.perf_counter() - start
            )
            hf_b, _ = hf_decode_ms(model, [[7] * 128], 256)
            hf_c, hf_c_tps = hf_decode_ms(model, [[7 + i] * 128 for i in range(64)], 256)
            rows.append(
                (
                    f"HF transformers CB (A on {n} requests)",
                    hf_a,
                    hf_b,
                    hf_c,
                    hf_c_tps,
                    float("nan"),
                )
            )

    sizes = element_bytes(args)
    tp = args.tensor_parallel_size
    fb, fc = (floor_ms(n, 128 + 128, bandwidth, *sizes) / tp for n in (1, 64))
    print(
        f"Heron weights {args.quantization or 'bf16'}, KV cache {args.kv_cache_dtype}, "
        f"tensor parallel {tp}; copy "
        f"bandwidth {bandwidth / 1e12:.2f} TB/s; floor B {fb:.3f} ms, C {fc:.3f} ms"
    )
    print(
        "| engine | A tok/s | B ms/step | B / floor | C ms/step | C / floor | C tok/s | D host idle |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, a, b, c, c_tps, idle in rows:
        print(
            f"| {name} | {a:,.0f} | {b:.3f} | {b / fb:.2f}x | {c:.3f} | {c / fc:.2f}x | "
            f"{c_tps:,.0f} | {idle:.1%} |"
        )


if __name__ == "__main__":
    main()
