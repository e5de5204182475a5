"""Turns next-token logits into tokens, one row per request, following each request's params.

The stages and their order follow vLLM: the grammar mask of structured outputs (a bitmask the
engine filled on the host, applied on the device), min_tokens masking, logit bias, penalties,
then greedy argmax or temperature / top-k / top-p / min-p and a random draw. Every stage works
on the whole batch at once with per-row parameter tensors and is skipped when no row needs it,
because this runs every step and the host-side cost is paid per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from heron.execution.request_state import RequestState
from heron.outputs import Logprob
from heron.sampling_params import SamplingParams
from heron.structured.bitmask import apply_token_bitmask

# Rows of prompt logits turned into log-probabilities at once; bounds the float32 copy
# (rows x vocab) that log_softmax needs for long prompts.
_PROMPT_LOGPROBS_CHUNK = 1024


@dataclass(frozen=True)
class SamplerOutput:
    """The sampled token of every row and, for rows whose request asked, its logprobs."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


class Sampler:
    """Samples one token per row of a ``[num_rows, vocab]`` logits tensor.

    Row ``i`` belongs to ``requests[i]``. A request with a seed carries its own
    ``torch.Generator`` (``request.generator``) and its row is drawn from it alone, so the same
    seed gives the same tokens whatever else shares the batch; the other rows share
    ``generator`` (the default generator when None).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[RequestState],
        generator: torch.Generator | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """``bitmask`` (host memory, one packed row per row) restricts rows to the tokens their
        grammars allow."""
        if all(map(on_device, requests)):
            # The common serving case: no stage needs the host.
            token_ids = self.sample_on_device(logits, requests, generator, bitmask).tolist()
            return SamplerOutput(token_ids, [None] * len(requests))
        params = [r.sampling_params for r in requests]
        # Logprobs are reported from the raw logits (vLLM's default), before any processing.
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
        )

        # A private float32 copy: the stages below work in place.
        logits = logits.to(torch.float32, copy=True)
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        apply_min_tokens(logits, requests)
        apply_logit_bias(logits, requests)
        logits = apply_penalties(logits, requests)
        token_ids = _choose(logits, requests, generator)

        logprobs: list[Logprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            entries = _logprob_entries(
                raw_logprobs, token_ids[logprob_rows], [params[i].logprobs for i in logprob_rows]
            )
            for i, entry in zip(logprob_rows, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def sample_on_device(
        self,
        logits: torch.Tensor,
        requests: Sequence[RequestState],
        generator: torch.Generator | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tokens of rows whose requests are all :func:`on_device`, left on the device:
        nothing here waits for the device, so the host can go on while they are drawn."""
        if all(r.sampling_params.plain_argmax for r in requests):
            return _argmax(logits)
        logits = logits.to(torch.float32, copy=True)  # private: the stages work in place
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        apply_logit_bias(logits, requests)
        return _choose(logits, requests, generator)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: on a GPU by the split Triton argmax (``torch.argmax`` spreads
    a 262,144-logit row over too few thread blocks)."""
    if logits.is_cuda and logits.stride(-1) == 1:
        from heron.kernels.argmax import greedy_argmax  # Triton only on GPU paths

        return greedy_argmax(logits)
    return logits.argmax(dim=-1)


def on_device(request: RequestState) -> bool:
    """Whether the request's next token can be sampled without the host: no logprobs to
    report, no penalty or ``min_tokens`` mask that depends on the tokens so far (which may still
    be on their way)."""
    p = request.sampling_params
    return (
        p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and request.num_output_tokens >= p.min_tokens
    )


def _choose(
    logits: torch.Tensor, requests: Sequence[RequestState], generator: torch.Generator | None
) -> torch.Tensor:
    """Greedy rows take their argmax, the others a draw from their sampling distribution.

    ``logits`` is a float32 copy (modified in place). Mixed batches draw every row (greedy rows
    at temperature 1) and pick per row on the device, so no row list travels to the device.
    """
    params = [r.sampling_params for r in requests]
    greedy = [p.greedy for p in params]
    if all(greedy):
        return _argmax(logits)
    if not any(greedy):
        return _draw(sampling_probs(logits, params), requests, generator)
    argmax = logits.argmax(dim=-1)
    drawn = _draw(sampling_probs(logits, params), requests, generator)
    return torch.where(to_device(greedy, logits.device), argmax, drawn)


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor, without waiting for the device (a pinned copy on
    CUDA; a plain copy from pageable memory would synchronise)."""
    host = torch.tensor(values)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[RequestState]) -> None:
    """Masks (in place) EOS and stop tokens of rows that have not yet reached ``min_tokens``."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            banned = [t for t in chain(params.eos_token_ids, params.stop_token_ids) if t < vocab]
            rows += [i] * len(banned)
            cols += banned
    if rows:
        logits[rows, cols] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[RequestState]) -> None:
    """Adds (in place) each row's ``logit_bias``; one upload, no wait for the device."""
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, request in enumerate(requests):
        bias = request.sampling_params.logit_bias or {}
        rows += [i] * len(bias)
        cols += bias.keys()
        biases += bias.values()
    if rows:
        index = to_device([rows, cols], logits.device)
        logits.index_put_(
            (index[0], index[1]), to_device(biases, logits.device).float(), accumulate=True
        )


def apply_penalties(logits: torch.Tensor, requests: Sequence[RequestState]) -> torch.Tensor:
    """Applies repetition, frequency and presence penalties; returns the penalised logits.

    Repetition penalty (HF / vLLM): over tokens of the prompt and the output, positive logits
    are divided by it and negative ones multiplied. Frequency and presence penalties (OpenAI):
    over output tokens only, subtract ``frequency * count + presence * (count > 0)``.
    Rows that do not use a penalty get an empty token list, so they are left unchanged.
    """
    params = [r.sampling_params for r in requests]
    uses_repetition = [p.repetition_penalty != 1.0 for p in params]
    if any(uses_repetition):
        seen = _token_counts(
            [r.all_token_ids if use else [] for r, use in zip(requests, uses_repetition)], logits
        )
        penalty = logits.new_tensor([p.repetition_penalty for p in params]).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen > 0, penalised, logits)
    uses_additive = [bool(p.frequency_penalty or p.presence_penalty) for p in params]
    if any(uses_additive):
        counts = _token_counts(
            [r.output_token_ids if use else [] for r, use in zip(requests, uses_additive)], logits
        )
        weights = logits.new_tensor([[p.frequency_penalty, p.presence_penalty] for p in params])
        logits = logits - counts * weights[:, :1] - (counts > 0) * weights[:, 1:]
    return logits


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row is drawn from: temperature, top-k, top-p, min-p.

    ``logits`` is modified in place. ``params[i]`` is the ``SamplingParams`` of row ``i``.
    """
    vocab = logits.shape[-1]
    # Greedy rows of a mixed batch are drawn too, at temperature 1; their draw is not used.
    values = to_device(
        [[p.temperature or 1.0, min(p.top_k or vocab, vocab), p.top_p, p.min_p] for p in params],
        logits.device,
    ).to(logits.dtype)
    logits.div_(values[:, 0:1])
    use_top_k = any(0 < p.top_k < vocab for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        _apply_top_k_top_p(
            logits,
            values[:, 1].long() if use_top_k else None,
            values[:, 2] if use_top_p else None,
        )
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = values[:, 3:4] * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits.softmax(dim=-1)


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor | Sequence[int], num_top: int
) -> list[Logprob]:
    """Logprob of each actual next prompt token at each of the ``P`` prompt positions.

    ``logits`` is ``[P, vocab]``; row ``j`` predicts ``next_token_ids[j]``. Each entry has the
    token's rank among all tokens and the ``num_top`` most likely tokens.
    """
    next_token_ids = torch.as_tensor(next_token_ids, device=logits.device)
    entries: list[Logprob] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        chunk = torch.log_softmax(logits[start : start + _PROMPT_LOGPROBS_CHUNK].float(), dim=-1)
        targets = next_token_ids[start : start + _PROMPT_LOGPROBS_CHUNK]
        entries += _logprob_entries(chunk, targets, [num_top] * chunk.shape[0])
    return entries


def _token_counts(token_lists: Sequence[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float counts of each token id in each row's list."""
    counts = torch.zeros_like(like)
    flat = list(chain.from_iterable(token_lists))
    if flat:
        lengths = torch.tensor([len(t) for t in token_lists], device=like.device)
        rows = torch.arange(len(token_lists), device=like.device).repeat_interleave(
            lengths, output_size=len(flat)
        )
        cols = torch.tensor(flat, device=like.device)
        counts.index_put_((rows, cols), torch.ones_like(cols, dtype=like.dtype), accumulate=True)
    return counts


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> None:
    """Masks (in place) tokens outside each row's top-k, then outside its top-p nucleus.

    One ascending sort serves both: the k-th largest value is at ``vocab - k``, and the nucleus
    is what remains after dropping the low tail whose total probability is ``<= 1 - top_p``
    (the smallest set with cumulative probability ``>= top_p``; the top token always stays).
    """
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        tail = cumulative <= (1.0 - top_p).unsqueeze(1)
        tail[:, -1] = False
        sorted_logits.masked_fill_(tail, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def _draw(
    probs: torch.Tensor, requests: Sequence[RequestState], generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row by the exponential race: ``argmax(probs / q)``, ``q ~ Exp(1)``.

    This equals sampling from ``probs`` and draws a fixed amount of noise per row, so a seeded
    row's tokens depend only on its own generator.
    """
    noise = torch.empty_like(probs)
    seeded = [(i, r.generator) for i, r in enumerate(requests) if r.generator is not None]
    if len(seeded) < len(requests):
        noise.exponential_(generator=generator)
    for i, row_generator in seeded:
        noise[i].exponential_(generator=row_generator)
    return probs.div_(noise).argmax(dim=-1)


def _logprob_entries(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[Logprob]:
    """A ``Logprob`` per row of ``logprobs`` for ``token_ids[row]`` with its ``num_top[row]``."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    # 1-based: how many tokens are strictly more likely, plus one.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(min(max(num_top, default=0), logprobs.shape[-1]), dim=-1)
    return [
        Logprob(token_id=token, logprob=value, rank=rank, top=dict(zip(ids[:n], values[:n])))
        for token, value, rank, ids, values, n in zip(
            token_ids.tolist(),
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            num_top,
        )
    ]
