"""What the HTTP front and the engine core process send each other (msgpack, via msgspec).

The front sends token ids and :class:`SamplingParams` (a dataclass msgspec encodes as is); the
core answers with the new tokens of each step, batched, and never with text: detokenisation and
stop strings are the front's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import torch

from heron.config import EngineConfig
from heron.engine.deltas import RequestDelta
from heron.lora.request import LoRARequest
from heron.multimodal.inputs import ImageItem
from heron.pooler_config import PoolerConfig
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams

if TYPE_CHECKING:
    from heron.engine.llm_engine import LLMEngine

# ----------------------------------------------------------------- front -> core


class ImageData(msgspec.Struct, array_like=True):
    """An :class:`ImageItem` on the wire: its pixel patches as raw float32 bytes."""

    content_hash: str
    pixels: bytes
    shape: tuple[int, ...]
    grid_thw: tuple[int, int, int]
    offset: int
    length: int

    @classmethod
    def of(cls, item: ImageItem) -> ImageData:
        pixels = item.pixel_values.float().contiguous()
        return cls(
            item.content_hash,
            pixels.numpy().tobytes(),
            tuple(pixels.shape),
            item.grid_thw,
            item.offset,
            item.length,
        )

    def item(self) -> ImageItem:
        values = torch.frombuffer(bytearray(self.pixels), dtype=torch.float32).view(self.shape)
        return ImageItem(self.content_hash, values, self.grid_thw, self.offset, self.length)


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    front: int = 0  # the sender's index: its outputs go back to it
    lora_request: LoRARequest | None = None  # an adapter the core gave (AdapterAdded)
    images: list[ImageData] = []  # the prompt's, its placeholders expanded in the token ids


class AddPoolingRequest(msgspec.Struct, tag=True, array_like=True):
    """A pooling model's request: answered by one final delta carrying its ``pooled``."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    front: int = 0


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    """Stop a request, or only one of its samples (a stop string the front matched)."""

    request_id: str
    sample_index: int | None = None


class AddAdapter(msgspec.Struct, tag=True, array_like=True):
    """Read and check a LoRA adapter; the core answers :class:`AdapterAdded` (the adapter's
    id, one per name) or :class:`Rejected` (``call_id`` in place of a request id)."""

    call_id: str
    lora_name: str
    lora_path: str
    front: int = 0


class RemoveAdapter(msgspec.Struct, tag=True, array_like=True):
    lora_name: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort every request, send their final outputs, and exit."""


class Control(msgspec.Struct, tag=True, array_like=True):
    """Call :class:`~heron.engine.rollout.RolloutControl`'s ``method`` (sleep, wake-up,
    weight updates, pause; :data:`CONTROL_METHODS`) with ``arguments``; answered by
    :class:`ControlDone` of the same ``call_id``."""

    call_id: int
    method: str
    arguments: dict[str, Any]
    front: int = 0


#: What :class:`Control` may call.
CONTROL_METHODS = frozenset(
    {
        "sleep",
        "wake_up",
        "is_sleeping",
        "reload_weights",
        "init_weight_update_group",
        "update_weights_from_distributed",
        "pause_generation",
        "resume_generation",
        "reset_prefix_cache",
    }
)

FrontMessage = (
    AddRequest | AddPoolingRequest | AbortRequest | AddAdapter | RemoveAdapter | Control | Shutdown
)

# ----------------------------------------------------------------- core -> front


class CacheGroupStats(msgspec.Struct, array_like=True):
    group: int
    spec: str  # the spec's description, a metrics label
    num_blocks: int  # usable ones (the null block left out)
    num_free_blocks: int
    usage: float


class EngineStats(msgspec.Struct, array_like=True):
    """The engine state /metrics reports, as a snapshot the core sends when it changes."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    kv_cache_free_blocks: int
    kv_cache_total_blocks: int
    groups: list[CacheGroupStats]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # speculative decoding (SpecDecodeStats): rows that verified proposals, proposed, accepted
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    # a KV connector's: (name, doc, value, whether a counter)
    connector: list[tuple[str, str, float, bool]]

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineStats:
        scheduler, kv, spec = engine.scheduler, engine.kv_cache, engine.spec_decode_stats
        groups = [
            CacheGroupStats(
                g.group, g.spec.describe(), g.num_blocks - 1, g.num_free_blocks, g.usage
            )
            for g in kv.group_usage()
        ]
        return cls(
            len(scheduler.running),
            len(scheduler.waiting),
            kv.usage,
            kv.num_free_blocks,
            kv.num_blocks - 1,
            groups,
            kv.prefix_cache_queries,
            kv.prefix_cache_hits,
            scheduler.num_preemptions,
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            [] if scheduler.connector is None else list(map(tuple, scheduler.connector.metrics())),
        )


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine is built; what the front needs of it."""

    model_path: str  # resolved (a GGUF file's converted directory)
    tokenizer: str  # what AutoTokenizer loads
    max_model_len: int
    eos_token_ids: list[int]
    description: str  # model, dtype, device and graph mode, for the start-up log
    stats: EngineStats
    pooling: PoolerConfig | None  # a pooling model's pooler; None: the model generates
    sleep_mode: bool = False  # the engine sleeps and updates weights (Control calls)
    image_limit: int | None = None  # most images a prompt (limit_mm_per_prompt; None: any)
    kv_transfer: dict | None = None  # a KV connector's handshake (GET /kv_transfer)


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    message: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    deltas: list[RequestDelta]
    stats: EngineStats | None  # None: unchanged, or not due yet


class Rejected(msgspec.Struct, tag=True, array_like=True):
    """The request was invalid (``ValueError``), or (``unavailable``) the engine takes no
    requests now (asleep, paused); nothing was queued."""

    request_id: str
    message: str
    unavailable: bool = False


class ControlDone(msgspec.Struct, tag=True, array_like=True):
    """A :class:`Control` call's result, or its error: ``"invalid"`` (a bad argument,
    ``ValueError``) or ``"conflict"`` (not now: the engine's state refuses it)."""

    call_id: int
    value: Any = None
    error: str | None = None
    error_kind: str | None = None


class AdapterAdded(msgspec.Struct, tag=True, array_like=True):
    call_id: str
    lora_request: LoRARequest


class StepFailed(msgspec.Struct, tag=True, array_like=True):
    """A step raised; these requests were aborted and the engine goes on."""

    request_ids: list[str]
    message: str


CoreMessage = (
    Ready | StartupFailed | StepOutputs | Rejected | AdapterAdded | StepFailed | ControlDone
)


class FrontEndpoints(msgspec.Struct, frozen=True):
    """One front's sockets, which it binds and the core connects to."""

    index: int
    input_address: str  # the core pulls this front's FrontMessages here
    output_address: str  # and pushes its CoreMessages here


class CoreArgs(msgspec.Struct):
    """The core process's start-up arguments."""

    config: EngineConfig
    fronts: list[FrontEndpoints]
    log_level: str
