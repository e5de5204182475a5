"""Engine and model configuration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from heron.layers.fp8 import FP8, QUANTIZATIONS
from heron.layers.quantization import WeightScheme, weight_scheme
from heron.lora.config import LoRAConfig
from heron.ops.backends import check_backend

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Blocks between the kept recurrent-state checkpoints of generated tokens (see EngineConfig):
# the latest only, since with a slot and one checkpoint's worth per request in the budget,
# kept blocks evict waiting conversations' latest states (heron bench turns, interval 1 or 4).
DEFAULT_DECODE_CHECKPOINT_INTERVAL = 0

# "auto": the checkpoint's safetensors (or GGUF) weights; "dummy": seeded random weights made on
# the device from config.json alone, as vLLM's, for benchmarks of shapes with no checkpoint.
LOAD_FORMATS = ("auto", "dummy")
# "auto": the KV cache in the model's dtype; "fp8": E4M3 (half the bytes of bf16).
KV_CACHE_DTYPES = ("auto", "fp8")
# Any of these lets AutoTokenizer load a directory (tokenizer_config.json alone does not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


# "generate": a text generator; "pooling": an embedding, classification or reward model (see
# heron.models.pooling); "auto": pooling where the checkpoint can only mean it.
RUNNERS = ("auto", "generate", "pooling")


def check_fields(name: str, cls: type, options: object, required: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless option ``name`` is a dictionary of ``cls``'s fields that
    holds every ``required`` one."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{name} must be a dictionary, got {type(options).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"{name}: unknown field(s) {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(sorted(known))})"
        )
    for field_name in required:
        if field_name not in options:
            raise ValueError(f"{name}: {field_name!r} is required")


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# Fields that only one method reads: refused by name for the others.
METHOD_FIELDS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": ("model", "draft_tensor_parallel_size", "async_verification"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How proposals are made, named as vLLM names them.

    ``ngram``: prompt lookup. The longest suffix of the sequence (``prompt_lookup_max`` tokens
    down to ``prompt_lookup_min``) that occurred before proposes the ``num_speculative_tokens``
    tokens that followed its latest earlier occurrence.

    ``draft_model``: a smaller model with the target's tokenizer (``model``, a path or hub
    name) proposes its greedy continuation; it runs on the target's first device
    (``draft_tensor_parallel_size`` 1). With ``async_verification`` (the default) the next
    step is scheduled and launched before a verification is read (rows moved back on the
    device by their refused proposals) where the caches allow it; on the H200 that is faster
    than reading each verification first (BENCHMARKS.md).

    ``mtp``: the checkpoint's multi-token-prediction head (DeepSeek-V3, Qwen3.5, Qwen3-Next)
    proposes from the target's hidden states, applied again to its own output for each
    further token.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # No proposals while more requests than this run: verification costs compute that large
    # batches do not have to spare (on the H200 it lost from batch 16 up: BENCHMARKS.md);
    # None: always propose.
    disable_by_batch_size: int | None = 8
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    async_verification: bool = True

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpeculativeConfig:
        """Raises ``ValueError`` naming the first bad or unknown field."""
        check_fields("speculative_config", cls, options, ("method", "num_speculative_tokens"))
        method = options["method"]
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}"
            )
        for other, names in METHOD_FIELDS.items():
            given = [name for name in names if name in options]
            if other != method and given:
                raise ValueError(
                    f"speculative_config: {given[0]} applies to method {other!r}, not {method!r}"
                )
        if method == "draft_model":
            model = options.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(
                    "speculative_config: 'model' (the draft model's path or name) is required "
                    f"for method 'draft_model', got {model!r}"
                )
            size = options.get("draft_tensor_parallel_size", 1)
            if isinstance(size, bool) or size != 1:
                raise ValueError(
                    "speculative_config: draft_tensor_parallel_size must be 1 (the draft runs "
                    f"on one device), got {size!r}"
                )
            if not isinstance(options.get("async_verification", False), bool):
                raise ValueError(
                    "speculative_config: async_verification must be true or false, got "
                    f"{options['async_verification']!r}"
                )
        values = dict(options)
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        ):
            value = values.get(name)
            if name not in values or (value is None and name == "disable_by_batch_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config: {name} must be an integer >= 1, got {value!r}"
                )
        config = cls(**values)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({config.prompt_lookup_max})"
            )
        return config


KV_CONNECTORS = ("offload", "nixl")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer", "prefill", "decode")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector moves cache blocks beyond the device pool, named as vLLM names it:
    ``kv_connector`` (``offload``: a host-memory tier; ``nixl``: prefill/decode
    disaggregation), ``kv_role`` (whether this instance saves, loads or both; ``prefill`` or
    ``decode`` for ``nixl``) and ``kv_connector_extra_config`` (the connector's own options,
    checked by the connector)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> KVTransferConfig:
        """Raises ``ValueError`` naming the first bad or unknown field."""
        check_fields("kv_transfer_config", cls, options, ("kv_connector",))
        config = cls(**options)
        if config.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                f"got {config.kv_connector!r}"
            )
        if config.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                f"got {config.kv_role!r}"
            )
        if not isinstance(config.kv_connector_extra_config, Mapping):
            raise ValueError(
                "kv_transfer_config: kv_connector_extra_config must be a dictionary, got "
                f"{type(config.kv_connector_extra_config).__name__}"
            )
        return config


@dataclass
class EngineConfig:
    """User-facing engine options, named as vLLM users know them."""

    # HF directory, .gguf file or Hub id (owner/name[:file.gguf]); None: the default model
    model: str | None = None
    revision: str | None = None  # of a Hub id: branch, tag or commit
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool = True
    # With prefix caching, a hybrid model's recurrent state of generated tokens is kept every
    # this many blocks, beside each request's latest one (0: the latest only; -1: none, only
    # where prefill chunks end)
    decode_checkpoint_interval: int = DEFAULT_DECODE_CHECKPOINT_INTERVAL
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cuda_graph_max_bs: int = 256
    async_scheduling: bool = True
    seed: int = 0
    num_kv_blocks: int | None = None
    attention_backend: str | None = None
    load_format: str = "auto"
    quantization: str | None = None  # QUANTIZATIONS; an FP8 checkpoint is read as FP8 anyway
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # {"method": "ngram", "num_speculative_tokens": k, ...}: see SpeculativeConfig
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1  # ranks one model is split over (one process each)
    # Fair prefill (vLLM's names): prefills of more tokens are long (None: half the step's
    # token budget; 0: none is); how many prefills, and long ones, may be in progress at once
    # (None: no limit).
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    # Bytes of the KV cache (None: measured on CUDA; on the CPU, a quarter of the available
    # memory, at most 2 GiB)
    kv_cache_memory_bytes: int | None = None
    # LoRA adapters (LLM.generate(..., lora_request=...), the server's --lora-modules): at most
    # max_loras of them in one step, each of rank at most max_lora_rank; max_cpu_loras read
    # ones kept in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    runner: str = "auto"  # RUNNERS
    # Sleep mode and weight updates (LLM.sleep / wake_up / update_weights; the server's
    # routes for them), for a trainer that shares the device
    enable_sleep_mode: bool = False
    # A KV connector: {"kv_connector": NAME, "kv_role": ..., ...}, see KVTransferConfig
    kv_transfer_config: dict[str, Any] | None = None
    # Bytes of host memory that keep KV blocks past the device pool (the offload connector)
    kv_offload_bytes: int | None = None
    # Attributes set on the checkpoint's config.json as loaded (vLLM's hf_overrides), e.g. a
    # causal LM served as a reranker by two tokens' logits (see heron.pooler_config)
    hf_overrides: dict[str, Any] | None = None
    # Most items of each modality in one prompt: {"image": N} (None: no limit)
    limit_mm_per_prompt: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Parsed once here (not a field: the options stay the user's).
        self._speculative = (
            None
            if self.speculative_config is None
            else SpeculativeConfig.from_dict(self.speculative_config)
        )
        self._lora = (
            LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.enable_lora
            else None
        )
        if self.enable_lora and self._speculative and self._speculative.method != "ngram":
            raise ValueError(
                f"enable_lora: speculative method {self._speculative.method!r} is not supported "
                "with LoRA adapters (n-gram proposals are)"
            )
        self._kv_transfer = self._check_kv_transfer()
        if self.hf_overrides is not None and not (
            isinstance(self.hf_overrides, dict) and all(map(str.isidentifier, self.hf_overrides))
        ):
            raise ValueError(
                f"hf_overrides must map config attribute names to values, got {self.hf_overrides!r}"
            )
        if self.attention_backend is not None:
            check_backend(self.attention_backend)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            if self.speculative_config["method"] == "mtp":
                raise ValueError(
                    "speculative_config: method 'mtp' needs tensor_parallel_size 1 (the MTP head "
                    f"is not sharded), got tensor_parallel_size={self.tensor_parallel_size}"
                )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.load_format == "dummy" and self.tokenizer is None and lacks_tokenizer(self.model):
            raise ValueError(
                f"load_format='dummy': {self.model} has no tokenizer files; pass tokenizer= "
                "(a directory with one, e.g. the default model's) to build the dummy model"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            if modality != "image":
                raise ValueError(
                    f"limit_mm_per_prompt: modality {modality!r} is not supported (images only)"
                )
            if not isinstance(limit, int) or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt: image must be an integer >= 0, got {limit!r}"
                )
        if self.block_size is not None and (
            self.block_size < 1 or self.block_size & (self.block_size - 1)
        ):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.decode_checkpoint_interval < -1:
            raise ValueError(
                f"decode_checkpoint_interval must be >= -1, got {self.decode_checkpoint_interval}"
            )
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        for name, least in _LEAST_VALUES.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if None not in (self.max_num_partial_prefills, self.max_long_partial_prefills) and (
            self.max_long_partial_prefills > self.max_num_partial_prefills
        ):
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The checked ``speculative_config``, or None without one."""
        return self._speculative

    @property
    def lora(self) -> LoRAConfig | None:
        """The checked LoRA options, or None without ``enable_lora``."""
        return self._lora

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The checked ``kv_transfer_config`` (``kv_offload_bytes`` is the ``offload``
        connector's), or None without a connector."""
        return self._kv_transfer

    def _check_kv_transfer(self) -> KVTransferConfig | None:
        if self.kv_offload_bytes is not None and self.kv_transfer_config is not None:
            raise ValueError(
                "kv_offload_bytes and kv_transfer_config both name a KV connector: give one"
            )
        if self.kv_offload_bytes is not None:
            if isinstance(self.kv_offload_bytes, bool) or not isinstance(
                self.kv_offload_bytes, int
            ):
                raise ValueError(
                    f"kv_offload_bytes must be an integer, got {self.kv_offload_bytes!r}"
                )
            options = {
                "kv_connector": "offload",
                "kv_connector_extra_config": {"num_bytes": self.kv_offload_bytes},
            }
        elif self.kv_transfer_config is not None:
            options = self.kv_transfer_config
        else:
            return None
        config = KVTransferConfig.from_dict(options)
        for name, given in (
            ("tensor_parallel_size", self.tensor_parallel_size > 1),
            ("speculative_config", self.speculative_config is not None),
            ("enable_prefix_caching=False", not self.enable_prefix_caching),
            ("enable_lora", self.enable_lora),
            ("enable_sleep_mode", self.enable_sleep_mode),
        ):
            if given:
                raise ValueError(
                    f"kv_transfer_config: the {config.kv_connector!r} connector is not "
                    f"combined with {name}"
                )
        return config


# The least value of these options, when given.
_LEAST_VALUES = {
    "max_num_batched_tokens": 1,
    "long_prefill_token_threshold": 0,
    "max_num_partial_prefills": 1,
    "max_long_partial_prefills": 1,
    "kv_cache_memory_bytes": 1,
}


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint."""

    path: Path
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    load_format: str = "auto"  # see LOAD_FORMATS
    seed: int = 0  # of the dummy weights
    quantization: WeightScheme | None = None  # how linear layers hold weights; None: dense
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.get_text_config().vocab_size

    @classmethod
    def from_path(
        cls,
        path: Path,
        dtype: str,
        device: torch.device,
        max_model_len: int | None,
        load_format: str = "auto",
        seed: int = 0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        hf_overrides: dict[str, Any] | None = None,
    ) -> ModelConfig:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a model directory: it has no config.json")
        hf_config = AutoConfig.from_pretrained(path)
        hf_config.update(hf_overrides or {})
        return cls(
            path=path,
            hf_config=hf_config,
            dtype=_resolve_dtype(dtype, hf_config, device),
            # A multimodal config keeps the language model's limits in its text config.
            max_model_len=_resolve_max_model_len(hf_config.get_text_config(), max_model_len),
            eos_token_ids=_eos_token_ids(path, hf_config),
            load_format=load_format,
            seed=seed,
            quantization=weight_scheme(hf_config, quantization),
            kv_cache_dtype=FP8 if kv_cache_dtype == "fp8" else None,
        )


def lacks_tokenizer(model: str | Path | None) -> bool:
    """Whether ``model`` is a directory without tokenizer files (the default model and GGUF
    files always bring theirs)."""
    if model is None:
        return False
    path = Path(model).expanduser()
    return path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES)


def _resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(
                f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}"
            ) from None
    if device.type == "cpu":
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def _resolve_max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if not 1 <= requested <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
    return requested


def _eos_token_ids(path: Path, hf_config: PretrainedConfig) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    if (path / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)
