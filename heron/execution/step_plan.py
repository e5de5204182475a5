"""The plain step plan the scheduler hands the runner, and the plain arrays it hands back.

Nothing here refers to engine objects: a plan pickles, and a runner (or a tensor-parallel
worker) can run from plans alone, keeping its own per-request state between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from heron.kv_transfer.base import KVConnectorMeta
from heron.lora.request import LoRARequest
from heron.multimodal.inputs import ImageItem
from heron.outputs import Logprob
from heron.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen: its tokens so far and how to sample it."""

    request_id: str
    token_ids: list[int]  # the prompt, then any output tokens already generated
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None  # the sample's own seed (its draws ignore the rest of the batch)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    images: tuple[ImageItem, ...] = ()  # the prompt's images (a multimodal model's)


@dataclass(frozen=True)
class TableUpdate:
    """Entries ``start:`` of a request's table in one cache group become ``block_ids``."""

    request_id: str
    group: int
    start: int
    block_ids: list[int]


@dataclass(frozen=True)
class EntryCopies:
    """In every cache tensor of one group, entry ``destinations[i]`` becomes a copy of entry
    ``sources[i]`` (all sources are read before any destination is written)."""

    group: int
    sources: list[int]
    destinations: list[int]


@dataclass(frozen=True)
class VerifiedCopies:
    """After a verification step, in every cache tensor of one group, entry
    ``destinations[i]`` becomes the state that ``request_ids[i]``'s row reached after its token
    ``positions[i]`` (one of its tokens but the last, kept by the verification), where the
    step accepted that token; a refused one is left as it is."""

    group: int
    request_ids: list[str]
    positions: list[int]
    destinations: list[int]


class SentTables:
    """How much of each request's tables the runner has been sent: a plan carries only the
    entries since (tables grow append-only, except where rejected proposals shrink them; a
    request sent again after a drop starts at 0)."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}
        self._shrunk: set[str] = set()  # requests whose runner tables are too long

    def updates(self, request_id: str, tables: list[list[int]]) -> list[TableUpdate]:
        sent = self._sent.setdefault(request_id, [0] * len(tables))
        shrunk = request_id in self._shrunk
        self._shrunk.discard(request_id)
        out = []
        for g, table in enumerate(tables):
            if len(table) != sent[g] or shrunk:
                out.append(TableUpdate(request_id, g, sent[g], table[sent[g] :]))
                sent[g] = len(table)
        return out

    def shrink(self, request_id: str, tables: list[list[int]]) -> None:
        """The request's tables were cut back: what follows their new ends is sent again (an
        update that ends a table clears the runner's entries past it)."""
        sent = self._sent.get(request_id)
        if sent is None:
            return
        for g, table in enumerate(tables):
            sent[g] = min(sent[g], len(table))
        self._shrunk.add(request_id)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._shrunk.discard(request_id)


@dataclass(frozen=True)
class StepPlan:
    """One step: the scheduled requests in row order, with their context (``num_computed``) and
    query (``num_new``) lengths, and whether the step samples their next token.

    The runner applies, in this order: ``finished_ids`` (forgotten), ``preempted_ids`` (their
    tables dropped; they come back with whole tables), ``new_requests``, ``table_updates``,
    ``copies_before`` (a prefix hit's state from its checkpoint into its slot); after the
    forward pass, ``copies_after`` (states saved into checkpoints), and once a verification
    step's tokens are accepted, ``copies_verified`` (the states at accepted tokens among them).
    A KV connector's transfers (``kv_connector``) bracket the forward pass: loads before it
    (into blocks of requests that wait for them, in no row of the step), saves after it.
    A running request's input tokens are the runner's own: its prompt and the tokens it sampled,
    then, in a verification step, its proposals (a decode row of ``1 + len(proposals)`` tokens
    whose every position is sampled): ``draft_token_ids`` on the host, or the first
    ``device_drafts`` tokens of its row of the :class:`DeviceDrafts` given to the launch.
    """

    request_ids: list[str] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    table_updates: list[TableUpdate] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    copies_before: list[EntryCopies] = field(default_factory=list)
    copies_after: list[EntryCopies] = field(default_factory=list)
    copies_verified: list[VerifiedCopies] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals to verify
    device_drafts: dict[str, int] = field(default_factory=dict)  # how many, left on the device
    # A draft's rows that ingest a verified block: all ``num_new`` tokens are the first that
    # many of the request's row of the launch's DeviceDrafts, each is sampled, and the row's
    # token is the one sampled after its last accepted token (the launch's Rollback says which).
    device_inputs: dict[str, int] = field(default_factory=dict)
    # Rows with a grammar: each sampled row's allowed tokens (xgrammar's packed int32 mask, in
    # host memory, one row per sampled row in order; other rows allow everything).
    token_bitmask: torch.Tensor | None = None
    kv_connector: KVConnectorMeta | None = None

    @property
    def has_work(self) -> bool:
        """Whether the runner has anything to do for the plan."""
        return bool(self.request_ids or self.finished_ids or self.preempted_ids) or (
            self.kv_connector is not None
        )

    @property
    def verifies(self) -> bool:
        """Whether some row verifies proposals."""
        return bool(self.draft_token_ids or self.device_drafts)

    def num_proposed(self, request_id: str) -> int:
        """How many proposals the request's row verifies."""
        return len(self.draft_token_ids.get(request_id, ())) or self.device_drafts.get(
            request_id, 0
        )


@dataclass(frozen=True)
class DeviceDrafts:
    """Proposals a model proposer left on the device, handed to the launch of the step that
    verifies them beside its plan (never pickled with it): ``request_ids[i]``'s are
    ``tokens[i, :counts[i]]``; the plan's ``device_drafts`` says how many of them a row
    verifies."""

    request_ids: list[str]
    counts: list[int]
    tokens: torch.Tensor  # [rows, width] int64 on the device

    @property
    def rows(self) -> dict[str, int]:
        return {request_id: i for i, request_id in enumerate(self.request_ids)}

    def to_lists(self) -> list[list[int]]:
        """Each request's proposals on the host (one download)."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.counts)]


@dataclass(frozen=True)
class Rollback:
    """How many proposed tokens each request's verification step refused, on the device,
    before the host knows: a step scheduled as if all were accepted has the rows of these
    requests moved back by that many positions on the device (positions, slots, KV
    lengths) before its forward pass."""

    request_ids: list[str]
    num_rejected: torch.Tensor  # [rows] int32 on the device

    @property
    def rows(self) -> dict[str, int]:
        return {request_id: i for i, request_id in enumerate(self.request_ids)}


@dataclass(frozen=True)
class StepOutput:
    """What a step sampled, in the plan's order of sampled rows: a token per row, or, after a
    verification step, ``1 + num_accepted[i]`` tokens of row ``i`` one after the other."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[Logprob | None]
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    num_accepted: list[int] = field(default_factory=list)  # empty: no row verified proposals
    # A pooling step's output (float32, on the host) of each request whose last token it
    # computed; it samples nothing.
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)

    def row_token_ids(self) -> list[list[int]]:
        """Each row's tokens."""
        if not self.num_accepted:
            return [[t] for t in self.token_ids]
        rows, start = [], 0
        for n in self.num_accepted:
            rows.append(self.token_ids[start : start + 1 + n])
            start += 1 + n
        return rows
