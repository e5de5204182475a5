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

from heron.execution.request_state import RequestState
from heron.execution.sampler import apply_logit_bias, sampling_probs, to_device


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
    depend on nothing else in the batch. Proposals on the device are read in the same
    download as the verdicts.
    """
    on_device = isinstance(proposals, DraftRows)
    counts = proposals.counts if on_device else [len(p) for p in proposals]
    logits, rows, starts = _biased(logits, states, counts)
    if all(r.sampling_params.greedy for r in rows):  # the host compares: no upload of the proposals
        if on_device:
            return accept_greedy(*proposals.download_with(logits.argmax(dim=-1)))
        return accept_greedy(proposals, logits.argmax(dim=-1).tolist())
    if on_device:
        proposed = proposals.flat
    else:
        proposed = to_device([t for p in proposals for t in (*p, -1)], logits.device)
    accepted, chosen = _verdicts(logits, rows, proposed, states, starts, generator)
    accepted, chosen, proposed = torch.stack([accepted.long(), chosen, proposed]).tolist()
    out = []
    for start, end in zip(starts, starts[1:]):
        p = proposed[start : end - 1]
        n = 0
        while n < len(p) and accepted[start + n]:
            n += 1
        out.append([*p[:n], chosen[start + n]])
    return out


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
