"""MTP proposals: the target checkpoint's multi-token-prediction head proposes from the target's
own hidden states, through a runner, a plan and a cache of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from heron.cache.coordinator import KVCacheCoordinator
from heron.execution.model_runner import LaunchedStep, ModelRunner
from heron.execution.step_plan import NewRequest, StepPlan
from heron.models.build import build_mtp
from heron.speculative.draft_model import GREEDY, DraftModelProposer

if TYPE_CHECKING:
    from heron.engine.request import Request
    from heron.models.mtp import MultiTokenPredictor


def load_mtp_runner(target: ModelRunner, attention_backend: str, max_rows: int) -> ModelRunner:
    """A runner of the target's MTP head (the target's weights stay shared), with room for
    steps of ``max_rows`` tokens; ``ValueError`` if the checkpoint has none."""
    model = target.model

    def build(model_config, platform, runner, backend, block_size, tp):
        return build_mtp(model, model_config, platform, runner, backend, block_size)

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


class _HeadSequence:
    """What the head's cache holds of one request, read by the cache coordinator as a request.

    The head's position ``p`` pairs token ``t_{p+1}`` with the target's hidden state at ``p``,
    so its tokens are the request's shifted by one (its blocks are hashed over those).
    ``num_computed_tokens`` positions hold the KV of accepted tokens.
    """

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "num_synced")
    wants_prompt_logprobs = False

    def __init__(self, request: Request) -> None:
        self.request_id = request.request_id
        self.all_token_ids = request.all_token_ids[1:]
        self.num_computed_tokens = 0
        self.num_synced = 0  # (all computed positions are accepted ones)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class MTPProposer(DraftModelProposer):
    """Each pass, for the requests that propose: the head catches up on the positions it does
    not hold (up to the request's last token, from the target hidden states taken since: an
    extend chunk per request, within the token budget), whose last position's logits give the
    first proposal; then ``limit - 1`` decode steps feed each proposal and the head's own
    output back. Positions the target never computed (its prefix-cache hits beyond the
    head's) get zero hidden states: a weaker proposal there, never a wrong output.

    The target's hidden rows are kept per request from the first position the head has not
    computed; the rows of the last position are kept after each pass (its output starts the
    next pass). The pool, plans and forgetting are a draft model's; the head only ever holds
    accepted positions, so a refusal costs it nothing.
    """

    wants_hidden_states = True

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

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        rows: list[tuple[int, _HeadSequence, int]] = []  # (index, sequence, limit)
        new_requests = []
        for i, (request, limit) in enumerate(zip(requests, limits)):
            limit = min(limit, self.num_tokens)
            if request.num_tokens < 2 or limit < 1:
                continue  # no hidden state before the first token
            seq = self._sequences.get(request.request_id)
            hits, num_hit = (), 0
            if seq is None:
                seq = _HeadSequence(request)
                hits, num_hit = self.kv_cache.get_computed_blocks(seq)
            else:
                seq.all_token_ids = request.all_token_ids[1:]
            # Positions up to the one before the last token, then limit - 1 drafted ones.
            num_new = seq.num_tokens - seq.num_computed_tokens - num_hit + limit - 1
            if not self.kv_cache.allocate_slots(seq, num_new, hits):
                continue  # no room in the head's pool: no proposals this pass
            if request.request_id not in self._sequences:
                self._sequences[request.request_id] = seq
                seq.num_computed_tokens = num_hit
                new_requests.append(
                    NewRequest(
                        request.request_id,
                        list(seq.all_token_ids),
                        request.num_prompt_tokens,
                        GREEDY,
                        None,
                    )
                )
            rows.append((i, seq, limit))
        out: list[list[int]] = [[] for _ in requests]
        if not rows:
            return out
        states = self.runner.requests
        launched, outputs = self._catch_up_from_hidden([seq for _, seq, _ in rows], new_requests)
        for s in range(1, max(limit for _, _, limit in rows)):
            decoding = [seq for _, seq, limit in rows if limit > s]
            self.head.stage_hidden(torch.cat([outputs[seq.request_id] for seq in decoding]))
            plan = StepPlan(
                request_ids=[seq.request_id for seq in decoding],
                num_computed=[seq.num_tokens - 1 + s for seq in decoding],
                num_new=[1] * len(decoding),
                samples=[True] * len(decoding),
            )
            last = launched[-1]
            if last.is_ready:  # (read at once: its tokens are the runner's already)
                last.result()
            launched.append(self.runner.launch(plan, None if last.is_ready else last))
            outputs.update(_sampled_rows(plan, launched[-1].hidden_states))
        for step in launched:
            step.result()
        for i, seq, limit in rows:
            out[i] = states[seq.request_id].all_token_ids[seq.num_tokens : seq.num_tokens + limit]
            # The last position is computed again next pass: its output starts the proposals.
            self._truncate(seq, seq.num_computed_tokens - 1)
            seq.num_synced = seq.num_computed_tokens
        return out

    def _catch_up_from_hidden(
        self, sequences: list[_HeadSequence], new_requests: list[NewRequest]
    ) -> tuple[list[LaunchedStep], dict[str, torch.Tensor]]:
        """Steps computing each sequence's missing positions from the target's hidden rows,
        within the token budget (every step but the last is read at once); and each
        sequence's output at its last position."""
        states = self.runner.requests
        plan = self._first_plan(new_requests)
        launched, outputs = [], {}
        pending = list(sequences)
        while pending:
            budget, hidden = self.max_num_batched_tokens, []
            for seq in pending:
                if budget == 0:
                    break
                remaining = seq.num_tokens - seq.num_computed_tokens
                num_new = min(remaining, budget)
                plan.request_ids.append(seq.request_id)
                plan.num_computed.append(seq.num_computed_tokens)
                plan.num_new.append(num_new)
                plan.samples.append(num_new == remaining)
                hidden.append(self._target_rows(seq.request_id, seq.num_computed_tokens, num_new))
                budget -= num_new
            for seq, num_new in zip(pending, plan.num_new):
                seq.num_computed_tokens += num_new
            pending = [seq for seq in pending if seq.num_computed_tokens < seq.num_tokens]
            if launched:
                launched[-1].result()
            for request_id in plan.request_ids:
                if request_id in states:  # (the runner appends its proposals to its copy)
                    tokens = self._sequences[request_id].all_token_ids
                    states[request_id].all_token_ids = list(tokens)
            self.head.stage_hidden(torch.cat(hidden))
            launched.append(self.runner.launch(plan))
            outputs.update(_sampled_rows(plan, launched[-1].hidden_states))
            plan = StepPlan()
        return launched, outputs

    def _target_rows(self, request_id: str, start: int, n: int) -> torch.Tensor:
        """The target's hidden rows of positions ``[start, start + n)`` (zeros where it
        computed none); the rows before ``start + n - 1`` are dropped."""
        first, held = self._hidden.get(request_id, (start, self.head.zero_hidden(0)))
        lo, hi = start - first, start + n - first
        if lo >= 0 and hi <= len(held):
            rows = held[lo:hi]
        else:
            rows = self.head.zero_hidden(n)
            src_lo, src_hi = max(lo, 0), min(hi, len(held))
            if src_lo < src_hi:
                rows[src_lo - lo : src_hi - lo] = held[src_lo:src_hi]
        self._hidden[request_id] = (start + n - 1, held[max(hi - 1, 0) :])
        return rows

    def forget(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)
        super().forget(request_id)


def _sampled_rows(plan: StepPlan, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sampling request's hidden state at its last row of ``plan`` (gathered: the rows
    outlive a graph's next replay)."""
    ends, offset = {}, 0
    for request_id, n, samples in zip(plan.request_ids, plan.num_new, plan.samples):
        offset += n
        if samples:
            ends[request_id] = offset - 1
    if not ends:
        return {}
    index = torch.tensor(list(ends.values()), device=hidden.device)
    return dict(zip(ends, hidden[index].unsqueeze(1)))
