"""Verification of proposals against the target model's own next-token distributions.

Greedy rows accept a proposal while it is the target's argmax. Sampled rows use rejection
sampling for a proposer that names one token (a point mass ``q``): proposal ``x`` at a position
whose target distribution is ``p`` is accepted with probability ``min(1, p(x) / q(x)) = p(x)``;
on refusal the token is drawn from ``max(0, p - q)`` renormalised, which is ``p`` without
``x``; after every proposal was accepted the next token is drawn from the last position's
``p``. Each emitted token is then distributed as ``p`` (Leviathan et al., 2023), whatever the
proposals were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from heron.cache.paged_parts import PagedParts
from heron.execution.launched import LaunchedStep, emitted_rows
from heron.execution.request_state import RequestState
from heron.execution.sampler import (
    Sampler,
    apply_logit_bias,
    on_device,
    sampling_probs,
    to_device,
)
from heron.execution.step_inputs import BlockTableRows, PreparedStep
from heron.execution.step_plan import DeviceDrafts, Rollback, StepOutput, StepPlan
from heron.metadata import MetadataOperator, SequenceMetadata, StepMetadataError
from heron.outputs import Logprob


@dataclass(frozen=True)
class DraftRows:
    """Proposals that are on the device, one row per verifying request: ``counts[i]`` tokens
    of row ``i``, then -1 (the row's last position, which verifies none), all rows in one
    flat int64 tensor. Read on the host only together with what verified them."""

    counts: list[int]
    flat: torch.Tensor

    def download_with(self, values: torch.Tensor) -> tuple[list[list[int]], list[int]]:
        """The proposals as lists, and ``values`` (int64, on the same device), in one
        download."""
        both = torch.cat([self.flat, values]).tolist()
        return _split(both, self.counts), both[len(self.flat) :]


def _split(flat: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Each row's proposals out of the flat layout of :class:`DraftRows`."""
    starts = accumulate((1 + n for n in counts), initial=0)
    return [list(flat[start : start + n]) for start, n in zip(starts, counts)]


def verify(
    logits: torch.Tensor,
    states: Sequence[RequestState],
    proposals: Sequence[Sequence[int]] | DraftRows,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """Each request's emitted tokens: its accepted proposals and one token after them.

    ``logits`` holds ``1 + len(proposals[i])`` consecutive rows for ``states[i]``: the
    distributions after its last token and after each proposal. A seeded request draws its
    uniforms and noise from its own generator, a fixed amount per position, so its tokens
    depend on nothing else in the batch. Greedy rows are compared on the host (no upload of
    the proposals); any other batch is :func:`verify_on_device`, its block of emitted tokens
    read in one download.
    """
    on_host = not isinstance(proposals, DraftRows)
    counts = [len(p) for p in proposals] if on_host else proposals.counts
    if all(s.sampling_params.greedy for s in states):
        targets = _biased(logits, states, counts)[0].argmax(dim=-1)
        if on_host:
            return accept_greedy(proposals, targets.tolist())
        return accept_greedy(*proposals.download_with(targets))
    if on_host:
        flat = to_device([t for p in proposals for t in (*p, -1)], logits.device)
        proposals = DraftRows(counts, flat)
    tokens, accepted = verify_on_device(logits, states, proposals, generator)
    ids = torch.cat([tokens.flatten(), accepted.long()]).tolist()
    return emitted_rows(ids, tokens.shape[1], ids[tokens.numel() :])


def verify_on_device(
    logits: torch.Tensor,
    states: Sequence[RequestState],
    proposals: DraftRows,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` with nothing read: each request's emitted tokens as a row of ``[rows,
    1 + max count]`` (valid up to its accepted count, inclusive) and its accepted counts, on
    the device. The same draws as :func:`verify`, so seeded requests get the same tokens."""
    logits, rows, starts = _biased(logits, states, proposals.counts)
    if all(r.sampling_params.greedy for r in rows):
        chosen = logits.argmax(dim=-1)
        return accepted_block(chosen == proposals.flat, chosen, proposals)
    accepted, chosen = _verdicts(logits, rows, proposals.flat, states, starts, generator)
    return accepted_block(accepted, chosen, proposals)


def _biased(
    logits: torch.Tensor, states: Sequence[RequestState], counts: Sequence[int]
) -> tuple[torch.Tensor, list[RequestState], list[int]]:
    """The rows' logits in fp32 with each request's logit bias, each row's request (``1 +
    counts[i]`` consecutive rows of ``states[i]``) and each request's first row."""
    rows = [s for s, n in zip(states, counts) for _ in range(1 + n)]
    logits = logits.to(torch.float32, copy=True)
    apply_logit_bias(logits, rows)
    return logits, rows, [0, *accumulate(1 + n for n in counts)]


def accepted_block(
    accepted: torch.Tensor, chosen: torch.Tensor, proposals: DraftRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """From per-position verdicts in the flat layout of :class:`DraftRows` (``accepted``: the
    position's proposal is taken; ``chosen``: the token drawn there otherwise), each row's
    emitted tokens ``[rows, 1 + max count]`` and accepted counts, on the device."""
    counts = proposals.counts
    width = 1 + max(counts)
    starts = accumulate((1 + n for n in counts), initial=0)
    index = [start + min(j, n) for start, n in zip(starts, counts) for j in range(width)]
    index = to_device(index, accepted.device).view(len(counts), width)
    num_accepted = accepted[index].int().cumprod(dim=1).sum(dim=1)
    tokens = torch.where(accepted, proposals.flat, chosen)[index]
    return tokens, num_accepted


def _verdicts(
    logits: torch.Tensor,
    rows: Sequence[RequestState],
    proposed: torch.Tensor,
    states: Sequence[RequestState],
    starts: Sequence[int],
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (``rows[i]``'s, biased ``logits[i]``, verifying ``proposed[i]``, -1 on a
    request's last position): whether its proposal is accepted, and the token chosen there
    otherwise (greedy rows: the argmax; sampled: a draw from ``p`` without the proposal, or
    from ``p`` on the last position)."""
    device = logits.device
    greedy = [r.sampling_params.greedy for r in rows]
    has_proposal = proposed >= 0
    safe = proposed.clamp(min=0).unsqueeze(1)
    targets = logits.argmax(dim=-1)
    probs = sampling_probs(logits, [r.sampling_params for r in rows])
    uniform = torch.empty(len(rows), device=device)
    noise = torch.empty_like(probs)
    _draw_noise(uniform, noise, states, starts, generator)
    accepted = (uniform < probs.gather(1, safe).squeeze(1)) & has_proposal
    # p without the proposal (the bonus rows, which have none, keep all of p)
    kept = probs.gather(1, safe) * ~has_proposal.unsqueeze(1)
    residual = probs.scatter(1, safe, kept)
    drawn = residual.div_(noise).argmax(dim=-1)
    is_greedy = to_device(greedy, device)
    accepted = torch.where(is_greedy, (targets == proposed) & has_proposal, accepted)
    return accepted, torch.where(is_greedy, targets, drawn)


def accept_greedy(proposals: Sequence[Sequence[int]], targets: Sequence[int]) -> list[list[int]]:
    """Greedy acceptance on the host: ``targets`` holds the target's argmax at each row (``1 +
    len(p)`` consecutive rows per request); proposals are accepted while they equal it, then
    the argmax after the last accepted one follows."""
    out, start = [], 0
    for p in proposals:
        n = 0
        while n < len(p) and p[n] == targets[start + n]:
            n += 1
        out.append([*p[:n], targets[start + n]])
        start += 1 + len(p)
    return out


def _draw_noise(
    uniform: torch.Tensor,
    noise: torch.Tensor,
    states: Sequence[RequestState],
    starts: Sequence[int],
    generator: torch.Generator | None,
) -> None:
    """Uniforms (acceptance) and exponential noise (the draws, by the race of ``_draw``) for
    every row; a seeded request's rows from its own generator."""
    seeded = [(i, s.generator) for i, s in enumerate(states) if s.generator is not None]
    if len(seeded) < len(states):
        uniform.uniform_(generator=generator)
        noise.exponential_(generator=generator)
    for i, row_generator in seeded:
        rows = slice(starts[i], starts[i + 1])
        uniform[rows].uniform_(generator=row_generator)
        noise[rows].exponential_(generator=row_generator)


class Verifier:
    """A verification step's sampling, beside the :class:`Sampler`: proposals written into the
    step's rows, verified against the logits (read at once, or left on the device), the
    caches brought back to the accepted tokens, and rows of a step run ahead of a
    verification moved back by its refusals.

    Rows without proposals are sampled as in any step (their one logits row), with the same
    draws either way, so a seeded request's tokens do not depend on how it was read.
    """

    def __init__(
        self,
        sampler: Sampler,
        generator: torch.Generator,
        tables: BlockTableRows,
        recurrent_owners: list[tuple[MetadataOperator, int]],
        device: torch.device,
    ) -> None:
        """``recurrent_owners``: the operators (with their cache groups) whose state a refused
        proposal cannot be cut out of: they keep each verified token's state."""
        self.sampler, self.generator = sampler, generator
        self.tables = tables
        self.recurrent_owners = recurrent_owners
        self.device = device

    def verify(
        self,
        plan: StepPlan,
        step: PreparedStep,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        drafts: DeviceDrafts | None,
        keep_on_device: bool,
    ) -> LaunchedStep:
        """The step's emitted tokens (``greedy_ids``: each row's argmax where the step drew
        them already), by the same draws in either form. ``keep_on_device``: nothing is read,
        each row's emitted tokens and refused count stay on the device
        (``LaunchedStep.emitted``, ``rollback``); else they are read at once and the caches
        keep the accepted tokens' states. A step of plain greedy rows (no logprobs) is
        accepted from its argmax (read: one download, the proposals too where they are on the
        device)."""
        states = step.sample_states
        counts = [plan.num_proposed(s.request_id) for s in states]
        rows = logits[step.sample_rows]
        if all(s.sampling_params.plain_argmax and on_device(s) for s in states):
            argmax = _argmax(rows, greedy_ids, step)
            proposals = self._proposals(plan, drafts, states, counts)
            if keep_on_device:
                emitted = accepted_block(argmax == proposals.flat, argmax, proposals)
            elif isinstance(proposals, DraftRows):
                emitted = accept_greedy(*proposals.download_with(argmax)), [None] * len(states)
            else:
                emitted = accept_greedy(proposals, argmax.tolist()), [None] * len(states)
        else:
            emitted = self._verify_and_sample(plan, drafts, states, counts, rows, keep_on_device)
        request_ids = [s.request_id for s in states]
        if keep_on_device:
            tokens, accepted = emitted
            rejected = (to_device(counts, self.device) - accepted).int()
            return LaunchedStep(
                states,
                token_ids=tokens.gather(1, accepted.long().unsqueeze(1)).squeeze(1),
                emitted=DeviceDrafts(request_ids, [1 + n for n in counts], tokens),
                rollback=Rollback(request_ids, rejected),
            )
        tokens, logprobs = emitted
        output = StepOutput(
            request_ids,
            [t for row_tokens in tokens for t in row_tokens],
            logprobs,
            step.prompt_logprobs(logits),
            [len(row_tokens) - 1 for row_tokens in tokens],
        )
        self._keep_accepted_states(plan, states, output)
        return LaunchedStep(states, result=output)

    def _proposals(
        self,
        plan: StepPlan,
        drafts: DeviceDrafts | None,
        states: list[RequestState],
        counts: list[int],
    ) -> list[list[int]] | DraftRows:
        """The proposals ``states[i]``'s row verifies (``counts[i]``): the plan's, or gathered
        from ``drafts`` on the device."""
        if plan.draft_token_ids:
            return [plan.draft_token_ids.get(s.request_id, []) for s in states]
        return self._draft_rows(drafts, states, counts)

    def _verify_and_sample(
        self,
        plan: StepPlan,
        drafts: DeviceDrafts | None,
        states: list[RequestState],
        counts: list[int],
        rows: torch.Tensor,
        keep_on_device: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[list[list[int]], list[Logprob | None]]:
        """Rows with proposals verified, then the others sampled (their one logits row): on
        the device, one ``[rows, 1 + max count]`` block of emitted tokens and the accepted
        counts; else read, each row's tokens and logprobs (the :class:`Sampler`'s:
        penalties and grammars included)."""
        starts, verified, index, plain = _verification_rows(counts)
        verified_states = [states[i] for i in verified]
        proposals = self._proposals(plan, drafts, verified_states, [counts[i] for i in verified])
        plain_rows, plain_states = rows[[starts[i] for i in plain]], [states[i] for i in plain]
        if keep_on_device:
            tokens = torch.zeros(
                (len(states), 1 + max(counts)), dtype=torch.int64, device=self.device
            )
            accepted = torch.zeros(len(states), dtype=torch.int64, device=self.device)
            if verified:
                block, num = verify_on_device(
                    rows[index], verified_states, proposals, self.generator
                )
                at = to_device(verified, self.device)
                tokens[at, : block.shape[1]] = block
                accepted[at] = num.long()
            if plain:
                sampled = self.sampler.sample_on_device(plain_rows, plain_states, self.generator)
                tokens[to_device(plain, self.device), 0] = sampled.long()
            return tokens, accepted
        emitted: list[list[int]] = [[] for _ in states]
        logprobs: list[Logprob | None] = [None] * len(states)
        if verified:
            for i, row_tokens in zip(
                verified, verify(rows[index], verified_states, proposals, self.generator)
            ):
                emitted[i] = row_tokens
        if plain:
            bitmask = plan.token_bitmask
            sampled = self.sampler(
                plain_rows,
                plain_states,
                self.generator,
                None if bitmask is None else bitmask[plain],
            )
            for i, token_id, logprob in zip(plain, sampled.token_ids, sampled.logprobs):
                emitted[i], logprobs[i] = [token_id], logprob
        return emitted, logprobs

    def _keep_accepted_states(
        self, plan: StepPlan, states: list[RequestState], output: StepOutput
    ) -> None:
        """Recurrent states go back to what the accepted tokens left (paged caches need
        nothing: refused positions are overwritten), and the tables' count of the tokens in
        each refusing row's caches to its accepted ones; the plan's ``copies_verified`` save
        the states at accepted tokens into checkpoints."""
        rows = {request_id: i for i, request_id in enumerate(plan.request_ids)}
        # each verifying row's place among the step's verifying rows (in row order)
        verifying = {r: j for j, r in enumerate(filter(plan.num_proposed, plan.request_ids))}
        copies = []
        num_accepted = {}
        for state, accepted in zip(states, output.num_accepted):
            request_id = state.request_id
            num_accepted[request_id] = accepted
            if accepted < plan.num_proposed(request_id):
                row = rows[request_id]
                self.tables.holds(request_id, plan.num_computed[row] + 1 + accepted)
                for owner, g in self.recurrent_owners:
                    slot = self.tables.first_block(request_id, g)
                    copies += owner.verified_state_copies(slot, verifying[request_id], accepted)
        for saves in plan.copies_verified:
            owners = [owner for owner, g in self.recurrent_owners if g == saves.group]
            for request_id, position, checkpoint in zip(
                saves.request_ids, saves.positions, saves.destinations
            ):
                if position <= num_accepted[request_id]:
                    for owner in owners:
                        copies += owner.verified_state_copies(
                            checkpoint, verifying[request_id], position
                        )
        if copies:
            torch._foreach_copy_(*map(list, zip(*copies)))

    def ingest(
        self,
        plan: StepPlan,
        step: PreparedStep,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        rejected: torch.Tensor | None,
    ) -> LaunchedStep:
        """A draft's step over verified blocks (``device_inputs`` rows only, greedy): each row's
        token is its greedy one after its last accepted token (its last, less its refusals)."""
        if len(plan.device_inputs) != len(plan.request_ids):
            raise ValueError("a step that ingests verified blocks takes no other rows")
        argmax = _argmax(logits[step.sample_rows], greedy_ids, step)
        q = plan.num_new[0]
        if all(n == q for n in plan.num_new):  # (uniform: no upload)
            last = torch.arange(q - 1, q * len(plan.num_new), q, device=self.device)
        else:
            last = to_device([end - 1 for end in accumulate(plan.num_new)], self.device)
        index = last if rejected is None else last - rejected
        return LaunchedStep(step.sample_states, token_ids=argmax[index])

    def fill_drafts(
        self, token_ids: torch.Tensor, sources: list[tuple[int, str, int]], drafts: DeviceDrafts
    ) -> None:
        """``token_ids[offset + j] = drafts.tokens[row, j]`` on the device, ``j < count``, for
        each ``(offset, request_id, count)``, the row being the request's."""
        row_of, width = drafts.rows, drafts.tokens.shape[1]
        n, lead = len(sources), sources[0][0]
        q = len(token_ids) // n
        if (
            q * n == len(token_ids)
            and lead + width <= q
            and all(
                offset == i * q + lead and row_of[request_id] == i and count == width
                for i, (offset, request_id, count) in enumerate(sources)
            )
        ):
            # Every row's whole row of drafts at one place in rows of one length (uniform
            # steps): one copy, no index upload.
            token_ids.view(n, q)[:, lead : lead + width].copy_(drafts.tokens[:n])
            return
        pairs = [
            (offset + j, row_of[request_id] * width + j)
            for offset, request_id, count in sources
            for j in range(count)
        ]
        index = to_device(pairs, self.device)
        token_ids[index[:, 0]] = drafts.tokens.flatten()[index[:, 1]].to(token_ids.dtype)

    def _draft_rows(
        self, drafts: DeviceDrafts, states: list[RequestState], counts: list[int]
    ) -> DraftRows:
        """The first ``counts[i]`` proposals of ``states[i]``'s row of ``drafts``, gathered
        into the layout verification reads (each row followed by -1), on the device."""
        tokens = drafts.tokens
        width = tokens.shape[1] + 1
        ended = torch.cat([tokens, tokens.new_full((tokens.shape[0], 1), -1)], dim=1).flatten()
        row_of = drafts.rows
        if all(
            row_of.get(state.request_id) == i and n == width - 1
            for i, (state, n) in enumerate(zip(states, counts))
        ):  # every row whole and in its place (uniform steps): no index upload
            return DraftRows(counts, ended[: len(states) * width])
        # (a row without proposals needs only a -1: any row's last column)
        index = [
            (row_of[state.request_id] if n else 0) * width + j
            for state, n in zip(states, counts)
            for j in (*range(n), width - 1)
        ]
        return DraftRows(counts, ended[to_device(index, self.device)])

    def move_back(self, plan: StepPlan, seq: SequenceMetadata, rejected: torch.Tensor) -> None:
        """Row ``i``'s positions and KV length go back by ``rejected[i]``, and its tokens'
        slots follow their positions (every cache group a full-attention one: each row's table
        starts at its first block; the engine runs ahead only then)."""
        rows = torch.arange(seq.num_reqs, device=self.device)
        repeats = to_device(plan.num_new, self.device)
        token_rows = torch.repeat_interleave(rows, repeats, output_size=seq.num_tokens)
        positions = seq.positions
        positions.sub_(rejected[token_rows])
        seq.kv_lens.sub_(rejected)
        bs = seq.block_size
        blocks, offsets = (positions // bs).long(), positions % bs
        for parts in seq.group_parts:
            if not isinstance(parts, PagedParts):
                raise StepMetadataError(
                    f"a step run ahead of a verification has {type(parts).__name__}, whose "
                    "rows cannot be moved back on the device"
                )
            parts.slot_mapping.copy_(parts.block_tables[token_rows, blocks] * bs + offsets)


def _argmax(
    rows: torch.Tensor, greedy_ids: torch.Tensor | None, step: PreparedStep
) -> torch.Tensor:
    """Each sampled row's argmax: the step's own where it drew them already."""
    return rows.argmax(dim=-1) if greedy_ids is None else greedy_ids[step.sample_rows]


def _verification_rows(counts: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """For the sampled rows of a verification step with ``counts[i]`` proposals each: each
    row's first logits row, the rows that verify, their logits rows, and the rows sampled
    plainly (no proposals)."""
    starts = [0, *accumulate(1 + n for n in counts)]
    verified = [i for i, n in enumerate(counts) if n]
    index = [r for i in verified for r in range(starts[i], starts[i + 1])]
    return starts, verified, index, [i for i, n in enumerate(counts) if not n]


def rejected_per_row(request_ids: list[str], rollback: Rollback) -> torch.Tensor | None:
    """Each row's refused count in ``rollback`` (0 for a request it lacks), on the device;
    None where it has none of the rows."""
    rows = rollback.rows
    index = [rows.get(request_id, -1) for request_id in request_ids]
    if max(index) < 0:
        return None
    if index == list(range(len(rollback.request_ids))):
        return rollback.num_rejected
    rejected = rollback.num_rejected
    padded = torch.cat([rejected, rejected.new_zeros(1)])
    return padded[to_device([i if i >= 0 else len(rejected) for i in index], rejected.device)]
