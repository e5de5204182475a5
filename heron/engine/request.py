"""A request as the engine sees it: one sample (sequence) of a user's request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from heron.cache.block_pool import root_hash
from heron.lora.request import LoRARequest
from heron.multimodal.inputs import ImageItem, block_hash_extras
from heron.outputs import Logprob
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams

if TYPE_CHECKING:
    from heron.structured.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    A user request with ``n > 1`` becomes ``n`` of these (``parent_id`` and ``sample_index`` say
    which); they share the prompt's KV blocks through the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    parent_id: str = ""
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Tokens sampled on the device whose values the host has not read yet (asynchronous
    # scheduling): they count in ``num_tokens`` but are not in ``all_token_ids``.
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at first schedule
    num_preemptions: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    grammar: RequestGrammar | None = None  # with structured outputs: where it is in its grammar
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    prefix_root: int = field(init=False)  # its prefix cache entries are its adapter's alone
    pooling_params: PoolingParams | None = None  # a pooling request's (it samples nothing)
    images: tuple[ImageItem, ...] = ()  # the prompt's images, in placeholder order
    # What a KV connector kept its blocks for, told to the client (a decode instance's input)
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.request_id
        self.all_token_ids = list(self.prompt_token_ids)
        self.prefix_root = root_hash(self.lora_request.lora_int_id if self.lora_request else 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, pending ones included."""
        return len(self.all_token_ids) + self.num_pending_tokens

    def pending_tokens_end_it(self, max_model_len: int) -> bool:
        """Whether the pending tokens bring it to ``max_tokens`` or ``max_model_len`` (so it
        finishes with them, and another step for it would be wasted)."""
        pending = self.num_pending_tokens
        if not pending:
            return False
        max_tokens = self.sampling_params.max_tokens
        return len(self.all_token_ids) + pending >= max_model_len or (
            max_tokens is not None and len(self.output_token_ids) + pending >= max_tokens
        )

    @property
    def waits_for_grammar(self) -> bool:
        """Its grammar is still being compiled: it cannot be scheduled yet."""
        return self.grammar is not None and not self.grammar.is_ready

    def block_extras(self, start: int, end: int) -> tuple[str, ...]:
        """The content hashes of the images whose placeholders lie in tokens ``start .. end``."""
        return block_hash_extras(self.images, start, end) if self.images else ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def keep_state_at(self) -> int:
        """A prefill instance's request (its first sample) keeps the recurrent state after all
        but its prompt's last token: what a decode instance, computing that token, starts from."""
        params = self.sampling_params.kv_transfer_params
        if not params or params.get("do_remote_decode") is not True or self.sample_index:
            return 0
        return self.num_prompt_tokens - 1

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
