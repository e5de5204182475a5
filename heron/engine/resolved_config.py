"""The engine's options with every ``auto`` settled: resolved once, before anything is built,
and read (frozen) by the builder, the runner and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from heron.config import TOKENIZER_FILES, EngineConfig, ModelConfig, SpeculativeConfig
from heron.config import lacks_tokenizer as _lacks_tokenizer
from heron.loader.resolve import resolve_model_path
from heron.platforms import Platform, platform_for, resolve_device
from heron.pooler_config import PoolerConfig, is_pooling_checkpoint, pooler_config

# With chunked prefill a step never exceeds this many tokens unless the user says otherwise.
# On the CPU, a step of more tokens than this takes seconds (a 135M-parameter model computes
# a 2,048-token chunk of a long prompt in about 15 s on two cores): an abort, a shutdown and
# every other request wait for the step to end.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 256}
FALLBACK_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ResolvedConfig:
    """``options`` as the user gave them (checked on construction), and what they resolve to."""

    options: EngineConfig
    model_path: Path  # the local HF directory (a GGUF file's converted copy, a Hub download)
    model: ModelConfig
    tokenizer: str | Path
    device: torch.device
    platform: Platform
    block_size: int
    attention_backend: str
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    speculative: SpeculativeConfig | None
    cuda_graphs: bool  # decode steps replay captured graphs
    pooling: PoolerConfig | None  # a pooling model's pooler (runner "pooling"); None: generates

    @property
    def max_graph_batch(self) -> int:
        return min(self.options.cuda_graph_max_bs, self.options.max_num_seqs)


def resolve(options: EngineConfig) -> ResolvedConfig:
    """Settle every ``auto`` (device, dtype, block size, backend, step budget, the model's
    path); raises ``ValueError`` naming what the model or the machine cannot take."""
    device = resolve_device(options.device)
    platform = platform_for(device)
    path = resolve_model_path(options.model, options.revision)
    model = ModelConfig.from_path(
        path,
        options.dtype,
        device,
        options.max_model_len,
        options.load_format,
        options.seed,
        options.quantization,
        options.kv_cache_dtype,
        options.hf_overrides,
    )
    tokenizer = options.tokenizer or path
    if _lacks_tokenizer(tokenizer):
        # transformers would build an empty tokenizer from the config alone.
        raise ValueError(
            f"{tokenizer} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "pass --tokenizer DIR"
        )
    max_num_batched_tokens = options.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(
        device.type, FALLBACK_MAX_NUM_BATCHED_TOKENS
    )
    # By default, while others wait, a long prefill leaves them half the step's budget.
    threshold = options.long_prefill_token_threshold
    pooling = _pooling(options, path, model)
    return ResolvedConfig(
        options=options,
        model_path=path,
        model=model,
        tokenizer=tokenizer,
        device=device,
        platform=platform,
        block_size=options.block_size or platform.default_block_size,
        attention_backend=options.attention_backend or platform.default_attention_backend(),
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=max(1, max_num_batched_tokens // 2)
        if threshold is None
        else threshold,
        speculative=options.speculative,
        # (a pooling model runs prefills only)
        cuda_graphs=device.type == "cuda" and not options.enforce_eager and pooling is None,
        pooling=pooling,
    )


def _pooling(options: EngineConfig, path: Path, model: ModelConfig) -> PoolerConfig | None:
    """The pooler of a pooling runner (asked for, or ``auto`` on a checkpoint that can only be
    a pooling model), refusing what it cannot run with."""
    runner = options.runner
    if runner == "auto":
        runner = "pooling" if is_pooling_checkpoint(path, model.architecture) else "generate"
    if runner == "generate":
        return None
    for name in ("speculative_config", "tensor_parallel_size"):
        if getattr(options, name) not in (None, 1):
            raise ValueError(f"{name} is not supported with the pooling runner")
    return pooler_config(path, model.hf_config, options.tokenizer or path)
