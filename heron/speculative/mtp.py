"""MTP proposals: the target checkpoint's multi-token-prediction head proposes from the target's
own hidden states, through a runner, a plan and a cache of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from heron.cache.coordinator import KVCacheCoordinator
from heron.execution.launched import LaunchedStep
from heron.execution.model_runner import ModelRunner
from heron.execution.sampler import to_device
from heron.execution.step_plan import DeviceDrafts, Rollback, StepPlan
from heron.models.build import build_mtp
from heron.speculative.draft_model import DraftModelProposer, _DraftSequence

if TYPE_CHECKING:
    from heron.engine.request import Request
    from heron.models.mtp import MultiTokenPredictor


def load_mtp_runner(target: ModelRunner, attention_backend: str, max_rows: int) -> ModelRunner:
    """A runner of the target's MTP head (the target's weights stay shared), with room for
    steps of ``max_rows`` tokens; ``ValueError`` if the checkpoint has none."""
    model = target.model

    def build(model_config, platform, backend, block_size, tp, lora):
        return build_mtp(model, model_config, platform, backend, block_size)

    runner = ModelRunner(
        target.model_config,
        target.platform,
        target.block_size,
        attention_backend,
        0,
        build=build,
    )
    if runner.num_cache_groups != 1:
        raise ValueError(f"an MTP head has one attention cache, got {runner.cache_specs}")
    runner.model.reserve_hidden_rows(max_rows)
    runner.keep_hidden_states = True
    return runner


class _HeadSequence(_DraftSequence):
    """What the head's cache holds of one request, read by the cache coordinator as a request.

    The head's position ``p`` pairs token ``t_{p+1}`` with the target's hidden state at ``p``,
    so its tokens are the request's shifted by one (its blocks are hashed over those), copied
    from the request's live list at each pass. Its computed positions are accepted ones.
    """

    __slots__ = ("request_tokens",)
    shift = 1

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self.request_tokens = request.all_token_ids
        self.all_token_ids = request.all_token_ids[1:]


class MTPProposer(DraftModelProposer):
    """A draft model's passes (catch-up, then ``limit - 1`` decode steps; its pool, plans and
    forgetting) over the MTP head, whose every step is fed hidden states: the target's for the
    catch-up (up to the request's last token), the head's own output at the previous step's
    row for each decode step. Positions the target never computed (its prefix-cache hits
    beyond the head's) get zero hidden states: a weaker proposal there, never a wrong output.

    The head holds accepted positions only: after each pass it goes back to its synced ones,
    so a refusal costs it nothing. A request's next catch-up is then the tokens its last
    verification step emitted, at most ``1 + k``: that catch-up is a uniform step of ``1 + k``
    positions a row (the draft's ingest of a verified block: the step's graphs replay it),
    the positions after the emitted tokens computed from whatever is there and never kept,
    the first proposal taken at the row's last emitted token. Any other row (a new request, a
    prefix hit, more to catch up, past the token budget) catches up eagerly, as a draft does.
    """

    wants_hidden_states = True
    caches_last_proposal = False

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache: KVCacheCoordinator,
        num_tokens: int,
        max_num_batched_tokens: int,
    ) -> None:
        super().__init__(runner, kv_cache, num_tokens, max_num_batched_tokens)
        self.head: MultiTokenPredictor = runner.model
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position, rows)
        # request -> the head's last output row (row i of a step's sampled rows), and the last
        # step's requests and rows (a decode step of the same rows stages them as they are)
        self._outputs: dict[str, tuple[torch.Tensor, int]] = {}
        self._last: tuple[list[str], torch.Tensor] = ([], self.head.zero_hidden(0))

    def _blocks_to_ingest(
        self, requests: Sequence[Request], verifying: LaunchedStep | None
    ) -> _HeadBlocks | None:
        """The catch-ups of the pass that take the uniform form: a known request's missing
        tokens (at most ``1 + k``: those its last verification emitted) padded to ``1 + k``,
        where its context has room for them and the step stays within the token budget, as a
        verified block the pass ingests (never run past a verification: the head's hidden
        states come from the host's positions)."""
        width = 1 + self.num_tokens
        max_len = self.runner.model_config.max_model_len
        max_rows = self.max_num_batched_tokens // width
        request_ids, rows = [], []
        for request in requests:
            seq = self._sequences.get(request.request_id)
            if seq is None or len(rows) == max_rows:
                continue
            missing = request.all_token_ids[1 + seq.num_computed_tokens :]
            if 0 < len(missing) <= width and seq.num_computed_tokens + width <= max_len:
                request_ids.append(request.request_id)
                pad = width - len(missing)
                rows.append([*missing, *missing[-1:] * pad, pad])  # (then its refused count)
        if not request_ids:
            return None
        uploaded = to_device(rows, self.runner.device)
        return _HeadBlocks(
            DeviceDrafts(request_ids, [width] * len(rows), uploaded[:, :width]),
            Rollback(request_ids, uploaded[:, width].int()),
        )

    def take_hidden_states(
        self,
        request_ids: Sequence[str],
        num_computed: Sequence[int],
        num_tokens: Sequence[int],
        hidden_states: torch.Tensor,
    ) -> None:
        """Rows ``[offset, offset + num_tokens[i])`` of ``hidden_states`` are the target's at
        positions ``num_computed[i]`` on (a refused proposal's are replaced when its position
        is computed again)."""
        offset = 0
        for request_id, start, n in zip(request_ids, num_computed, num_tokens):
            rows = hidden_states[offset : offset + n]
            offset += n
            kept = self._hidden.get(request_id)
            if kept is not None and kept[0] <= start <= kept[0] + len(kept[1]):
                first, held = kept
                self._hidden[request_id] = (first, torch.cat([held[: start - first], rows]))
            else:
                self._hidden[request_id] = (start, rows.clone())

    def _new_sequence(self, request: Request) -> _HeadSequence:
        return _HeadSequence(request)

    def _sync(self, seq: _HeadSequence, ingests: bool) -> None:
        """The request's tokens, less those of a uniform catch-up (the block it ingests holds
        them); otherwise at least the last is computed again (its output gives the first
        proposal)."""
        tokens = seq.request_tokens[1:]
        if ingests:
            tokens = tokens[: seq.num_computed_tokens]
        seq.all_token_ids = tokens
        if not ingests and seq.num_computed_tokens >= len(tokens):
            self._truncate(seq, len(tokens) - 1)
        self.runner.requests[seq.request_id].all_token_ids = list(tokens)

    def _took_block(self, seq: _HeadSequence, verifying, row: int, count: int) -> None:
        """A uniform catch-up's known tokens are the request's (the host has them)."""
        seq.num_computed_tokens = seq.num_synced = len(seq.request_tokens) - 1

    def _launch(self, plan: StepPlan, previous=None, rollback=None, block=None) -> LaunchedStep:
        """Stage the step's hidden states (a catch-up's from the target, a decode step's from
        the head's last outputs), then launch it; its decode steps are at their true
        positions (the host knows every catch-up's tokens): only a uniform catch-up takes its
        block's refusals (the padding), which say where each row's proposal is."""
        if previous is None:
            rows = map(self._target_rows, plan.request_ids, plan.num_computed, plan.num_new)
            self.head.stage_hidden(torch.cat(list(rows)))
        elif plan.request_ids == self._last[0]:
            self.head.stage_hidden(self._last[1])
        else:
            outputs = (self._outputs[request_id] for request_id in plan.request_ids)
            self.head.stage_hidden(torch.cat([rows[i : i + 1] for rows, i in outputs]))
        launched = self.runner.launch(
            plan, previous, block, rollback if block is not None else None
        )
        padding = {}
        if block is not None:
            known = self._sequences
            padding = {
                r: n - (len(known[r].request_tokens) - 1 - c)
                for r, c, n in zip(plan.request_ids, plan.num_computed, plan.num_new)
            }
        # (a decode step's rows are staged by the next step, before its replay: no gather)
        request_ids, rows = _sampled_rows(
            plan, launched.hidden_states, padding, gather=previous is None
        )
        self._last = request_ids, rows
        self._outputs.update((request_id, (rows, i)) for i, request_id in enumerate(request_ids))
        return launched

    def _end_pass(self, sequences: list[_HeadSequence]) -> None:
        """Back to the synced positions (accepted ones); the target's hidden rows from the
        last of them on are kept (the next pass starts after it, or recomputes it)."""
        self._outputs.clear()
        self._last = ([], self._last[1][:0])
        for seq in sequences:
            seq.all_token_ids = seq.request_tokens[1:]
            self._truncate(seq, seq.num_synced)
            first, held = self._hidden.get(seq.request_id, (0, None))
            if held is not None:
                keep = max(seq.num_synced - 1 - first, 0)
                self._hidden[seq.request_id] = (first + keep, held[keep:])

    def _target_rows(self, request_id: str, start: int, n: int) -> torch.Tensor:
        """The target's hidden rows of positions ``[start, start + n)`` (zeros where it
        computed none)."""
        first, held = self._hidden.get(request_id, (start, self.head.zero_hidden(0)))
        lo, hi = start - first, start + n - first
        if lo >= 0 and hi <= len(held):
            return held[lo:hi]
        rows = self.head.zero_hidden(n)
        src_lo, src_hi = max(lo, 0), min(hi, len(held))
        if src_lo < src_hi:
            rows[src_lo - lo : src_hi - lo] = held[src_lo:src_hi]
        return rows

    def forget(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)
        super().forget(request_id)


class _HeadBlocks:
    """A pass's uniform catch-ups, in the form of a verification's emitted blocks that a draft
    ingests: each row's tokens (``emitted``) and its padding past them (``rollback``)."""

    def __init__(self, emitted: DeviceDrafts, rollback: Rollback) -> None:
        self.emitted, self.rollback = emitted, rollback
        self.rows = emitted.rows


def _sampled_rows(
    plan: StepPlan, hidden: torch.Tensor, padding: dict[str, int], gather: bool
) -> tuple[list[str], torch.Tensor]:
    """The sampling requests, and the hidden state of each at its last row of ``plan`` before
    its ``padding``; ``gather``: copied out (the rows outlive a graph's next replay), else,
    where every row is one sampled token, the rows as they are."""
    ends, offset = {}, 0
    for request_id, n, samples in zip(plan.request_ids, plan.num_new, plan.samples):
        offset += n
        if samples:
            ends[request_id] = offset - 1 - padding.get(request_id, 0)
    if not gather and len(ends) == offset:
        return plan.request_ids, hidden[:offset]
    if not ends:
        return [], hidden[:0]
    index = to_device(list(ends.values()), hidden.device)
    return list(ends), hidden[index]
