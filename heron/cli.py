"""Command line: heron generate | chat | plan | serve | bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, fields
from pathlib import Path

from heron import __version__
from heron.bench.cli import add_bench_parser
from heron.config import EngineConfig
from heron.outputs import CompletionOutput
from heron.sampling_params import SamplingParams

# Engine flags, named like vLLM's: --max-num-seqs, --enable-prefix-caching/--no-..., ...
_ENGINE_FLAG_HELP = {
    "model": "HF directory, .gguf file or Hub id: owner/name, owner/name:file.gguf "
    "(default: the embedded SmolLM2-135M-Instruct)",
    "revision": "branch, tag or commit of a Hub id (default: main)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "auto, float32, float16 or bfloat16",
    "device": "auto, cpu or cuda[:N]",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one step (chunked prefill)",
    "block_size": "tokens per KV cache block",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "decode_checkpoint_interval": "hybrid models with prefix caching: keep the recurrent state "
    "of generated tokens every N blocks, beside each request's latest (0: the latest only; "
    "-1: none, only where prefill chunks end)",
    "gpu_memory_utilization": "fraction of the GPU this engine may use (its own share, as "
    "vLLM's: what other processes held before it started is not counted against it)",
    "enforce_eager": "never use CUDA graphs",
    "cuda_graph_max_bs": "largest decode batch captured as a CUDA graph",
    "async_scheduling": "prepare the next step while the device runs this one",
    "seed": "seed of requests that have none",
    "num_kv_blocks": "fix the KV pool size in blocks",
    "attention_backend": "attention operator (default: the platform's)",
    "load_format": "auto (the checkpoint's weights) or dummy (seeded random weights from "
    "config.json alone, for benchmarks; give --tokenizer if the directory has none)",
    "quantization": "fp8: FP8 E4M3 linear and expert weights quantised at load (FP8 "
    "checkpoints are read as FP8 without it)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (E4M3: half of bf16's bytes per block)",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
    '"model": "DRAFT", "num_speculative_tokens": 3}\' or \'{"method": "mtp", '
    "\"num_speculative_tokens\": 1}' (the checkpoint's MTP head)",
    "tensor_parallel_size": "split the model over this many GPUs (processes) of the host; "
    "under torchrun, over its ranks (python -m heron.distributed.launch)",
    "long_prefill_token_threshold": "prefills of more tokens are long: while others wait, "
    "a long one computes this many a step (default: half the token budget; 0: none is long)",
    "max_num_partial_prefills": "most prefills in progress at once (default: no limit)",
    "max_long_partial_prefills": "most long prefills in progress at once; short prompts pass "
    "the others (default: no limit)",
    "kv_cache_memory_bytes": "KV cache size in bytes (default: measured on CUDA; on the CPU "
    "a quarter of the available memory, at most 2 GiB)",
    "runner": "generate, pooling (embedding, classification, reward models) or auto "
    "(pooling for sequence classifiers, bare decoders and sentence-transformers checkpoints)",
    "enable_sleep_mode": "allow sleep / wake-up and in-place weight updates (for RL "
    "rollouts); the server then serves /sleep, /wake_up, /update_weights_from_disk, ...",
    "enable_lora": "serve LoRA adapters (PEFT format) beside the base model",
    "max_loras": "adapters that can run in one step (device slots)",
    "max_lora_rank": "the largest adapter rank the device slots hold",
    "max_cpu_loras": "adapters kept loaded in host memory (default: max_loras)",
    "kv_transfer_config": 'a KV connector as JSON, e.g. \'{"kv_connector": "offload", '
    '"kv_connector_extra_config": {"num_bytes": 8000000000}}\' (extra config: num_bytes, '
    "load_timeout_s), or for prefill/decode "
    'disaggregation \'{"kv_connector": "nixl", "kv_role": "prefill"}\' (or "decode"; '
    "extra config: hold_timeout_s, transfer_timeout_s, on_read_failure, kv_transfer_mode "
    '"layerwise" or "whole")',
    "hf_overrides": "attributes to set on the checkpoint's config as JSON, e.g. a causal LM "
    'reranking by two tokens\' logits: \'{"architectures": ["Qwen3ForSequenceClassification"], '
    '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'',
    "kv_offload_bytes": "keep KV blocks past the device pool in this many bytes of host "
    "memory (the offload connector): prefixes evicted from the device are loaded back "
    "instead of recomputed",
    "limit_mm_per_prompt": "most images in one prompt, as JSON: '{\"image\": 4}' (default: "
    "no limit)",
}
# Short spellings vLLM users type.
_SHORT_FLAGS = {"tensor_parallel_size": "-tp"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = _ENGINE_FLAG_HELP[f.name]
        if f.type in ("bool", bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            kind = {
                "int": int,
                "float": float,
                "int | None": int,
                "float | None": float,
                "dict[str, Any] | None": _json_object,
            }.get(str(f.type), str)
            flags = (flag, _SHORT_FLAGS[f.name]) if f.name in _SHORT_FLAGS else (flag,)
            parser.add_argument(*flags, type=kind, default=f.default, help=help_text)


def _lora_module(text: str) -> tuple[str, str]:
    """A ``--lora-modules`` entry, ``name=path``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def _json_object(text: str) -> dict:
    """A flag's JSON object (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sample-seed", type=int, default=None, help="seed of this request")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from heron.llm import LLM

    llm = LLM(**asdict(engine_config(args)))
    prompts = args.prompt or [sys.stdin.read()]
    for output in llm.generate(prompts, sampling_params(args), use_tqdm=len(prompts) > 1):
        if output.error:
            print(f"error: {output.error}", file=sys.stderr)
            return 1
        sample = output.outputs[0]
        print(sample.text)
        if _ended_at_once(sample):
            hint = "; it is a chat model: try heron chat" if llm.tokenizer.chat_template else ""
            print(
                f"heron: the model ended the completion at once (end of sequence){hint}",
                file=sys.stderr,
            )
    return 0


def _ended_at_once(sample: CompletionOutput) -> bool:
    """Whether the first token was end-of-sequence: what an instruct model often answers to
    a raw prompt without its chat template."""
    return (
        sample.finish_reason == "stop" and sample.stop_reason is None and len(sample.token_ids) == 1
    )


def cmd_chat(args: argparse.Namespace) -> int:
    from heron.llm import LLM

    llm = LLM(**asdict(engine_config(args)))
    params = sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if args.prompt:
        messages.append({"role": "user", "content": " ".join(args.prompt)})
        print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
        return 0
    print("heron chat: type a message, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        output = llm.chat(messages, params, use_tqdm=False)[0]
        if output.error:
            print(f"error: {output.error}", file=sys.stderr)
            messages.pop()
            continue
        reply = output.outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def cmd_plan(args: argparse.Namespace) -> int:
    from heron.engine.llm_engine import LLMEngine
    from heron.layers.quantization import describe_weights

    engine = LLMEngine(engine_config(args))
    runner = engine.runner
    plan = runner.plan.describe()
    scheme = engine.model_config.quantization
    plan["weights"] = describe_weights(scheme, getattr(runner, "model", None))
    plan["cache_groups"] = [
        {
            "group": u.group,
            "spec": {"kind": type(u.spec).__name__, **_json_fields(u.spec)},
            "description": u.spec.describe(),
            "num_blocks": u.num_blocks - 1,
            "pool": engine.kv_cache.groups[u.group].describe_pool(),
            "layers": runner.cache.group_layers(u.group),
        }
        for u in engine.kv_cache.group_usage()
    ]
    connector = engine.scheduler.connector
    plan["kv_connector"] = None if connector is None else connector.describe()
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    for group in plan["groups"]:
        reads = group["cache_group"]
        print(
            f"metadata group {group['group']}: {group['builder']}  key={json.dumps(group['key'])}"
            f"  graphs={group['graph_support']}{'  (fallback)' if group['fallback'] else ''}"
            + ("" if reads is None else f"  reads cache group {reads}")
        )
        for layer in group["layers"]:
            print(f"    {layer}")
    print(f"fallback: {plan['fallback_reason'] or 'none'}")
    print(f"weights: {plan['weights']}")
    for cache in plan["cache_groups"]:
        print(f"cache group {cache['group']}: {cache['description']}; {cache['pool']}")
        for layer in cache["layers"]:
            print(f"    {layer}")
    print(f"KV connector: {plan['kv_connector'] or 'none'}")
    return 0


def _json_fields(spec: object) -> dict[str, object]:
    """A spec's fields as JSON data (a dtype by its name)."""
    plain = (bool, int, float, str, type(None))
    return {
        f.name: v if isinstance(v, plain) else str(v).removeprefix("torch.")
        for f in fields(spec)
        for v in [getattr(spec, f.name)]
    }


def cmd_serve(args: argparse.Namespace) -> int:
    from heron.chat_template import load_chat_template
    from heron.engine.core_client import EngineStartupError
    from heron.multimodal.media import MediaPolicy
    from heron.server.chat_output import ChatOutputConfig
    from heron.server.front import ServeOptions, listen
    from heron.server.security import parse_allowed_origins

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(
                f"the model is given twice: {args.model_tag!r} and --model {args.model!r}"
            )
        args.model = args.model_tag
    logging.getLogger("heron").setLevel(min(logging.INFO, logging.getLogger().level))
    config = engine_config(args)
    options = ServeOptions(
        args.host,
        args.port,
        args.api_key,
        args.served_model_name,
        config.model,
        args.log_level,
        args.max_request_body_bytes,
        args.trust_request_chat_template,
        ChatOutputConfig(
            args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice
        ),
        allowed_origins=parse_allowed_origins(args.allowed_origins),
        timeout_keep_alive=args.timeout_keep_alive,
        chat_template=None
        if args.chat_template is None
        else load_chat_template(args.chat_template),
        lora_modules=tuple(args.lora_modules),
        media=MediaPolicy(
            frozenset(d.lower() for d in args.allowed_media_domains),
            None if args.allowed_local_media_path is None else Path(args.allowed_local_media_path),
        ),
    )
    try:
        listener = listen(options.host, options.port)  # before the model loads
        if args.api_server_count > 1:
            # That many front processes on one port, and a launcher (this process).
            from heron.server.api_servers import serve_with_api_servers

            return serve_with_api_servers(config, options, args.api_server_count, listener)
        from heron.server.front import serve

        return serve(config, options, listener)
    except EngineStartupError as e:
        print(f"heron: error: the engine could not start: {e}", file=sys.stderr)
        return 2


def cmd_router(args: argparse.Namespace) -> int:
    from heron.server.router import run_router

    return run_router(args.prefill, args.decode, args.host, args.port)


def cmd_bench(args: argparse.Namespace) -> int:
    from heron.bench.cli import run

    return run(args, engine_config(args) if hasattr(args, "model") else None, args.argv)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from heron.server.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES
    from heron.server.security import DEFAULT_TIMEOUT_KEEP_ALIVE_S

    parser = argparse.ArgumentParser(prog="heron", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--version", action="version", version=f"heron {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable; default: stdin)")
    chat = sub.add_parser(
        "chat", help="chat with the model (interactive, or one-shot with --prompt)"
    )
    chat.add_argument("--prompt", nargs="*", help="one message; answer it and exit")
    chat.add_argument("--system", default=None, help="system message")
    plan = sub.add_parser("plan", help="show the model's resolved step-metadata plan")
    plan.add_argument("--json", action="store_true")
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as --model (vllm serve MODEL)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--served-model-name", default=None, help="model name of the API (default: --model)"
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served (with --enable-lora): a request selects one by its model",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools on its own (tool_choice "auto"; needs --tool-call-parser)',
    )
    serve.add_argument(
        "--tool-call-parser", default=None, help="tool-call format: hermes or llama3_json"
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think> reasoning into reasoning_content: qwen3 or deepseek_r1",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with 413",
    )
    serve.add_argument(
        "--api-server-count",
        type=_positive,
        default=1,
        help="HTTP front processes sharing the port and the engine core (tokenisation, "
        "templates, detokenisation, parsers in each)",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (a Jinja template the server runs)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH_OR_TEXT",
        help="the chat template (a file, or Jinja text) instead of the tokenizer's",
    )
    serve.add_argument(
        "--allowed-origins",
        default="[]",
        help="web origins that may call the API from a browser (CORS), as a JSON list: "
        '\'["http://localhost:3000"]\' (default: none; ["*"]: any)',
    )
    serve.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        metavar="DOMAIN",
        help="hosts whose http(s) image URLs the server fetches (default: none; data: URLs "
        "are always read)",
    )
    serve.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="file:// image URLs are read from under this directory (default: none)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=_positive,
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        help="seconds an idle connection stays open, and that a request's headers may take",
    )
    router = sub.add_parser(
        "router",
        help="an OpenAI-compatible proxy over prefill and decode instances (prefill/decode "
        "disaggregation)",
    )
    router.add_argument(
        "--prefill", nargs="+", required=True, metavar="URL", help="prefill instances"
    )
    router.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode instances"
    )
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=_port, default=8000)
    router.set_defaults(func=cmd_router)
    bench = sub.add_parser("bench", help="benchmarks: decode, throughput, serve, spec, ...")
    add_bench_parser(bench, add_engine_args)
    for p in (gen, chat, plan, serve):
        add_engine_args(p)
    for p in (gen, chat):
        add_sampling_args(p)
    gen.set_defaults(func=cmd_generate)
    chat.set_defaults(func=cmd_chat)
    plan.set_defaults(func=cmd_plan)
    serve.set_defaults(func=cmd_serve)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"heron: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
