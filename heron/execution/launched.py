"""A launched step: its device work queued, its tokens read when the engine asks."""

from __future__ import annotations

import torch

from heron.execution.request_state import RequestState
from heron.execution.step_plan import DeviceDrafts, Rollback, StepOutput


class LaunchedStep:
    """A step whose device work is queued; :meth:`result` reads what it sampled.

    A step whose sampled rows all sample on the device (greedy or random, without logprobs,
    penalties or a pending ``min_tokens``: :func:`~heron.execution.sampler.on_device`) keeps
    its tokens on the device (``token_ids``) and copies them to pinned host memory without
    waiting, so the host can schedule and prepare the next step while this one runs; the next
    step takes its pending input tokens straight from ``token_ids``. Any other step is read on
    the spot (``is_ready``).

    A verification step left on the device (``ModelRunner.async_verification``) also keeps
    each row's emitted tokens (``emitted``: its accepted proposals and the token after them,
    ``token_ids`` being that last one) and its refused count (``rollback``), for the next
    step to be corrected by on the device and a draft to ingest.
    """

    def __init__(
        self,
        sample_states: list[RequestState],
        token_ids: torch.Tensor | None = None,
        result: StepOutput | None = None,
        hidden_states: torch.Tensor | None = None,
        emitted: DeviceDrafts | None = None,
        rollback: Rollback | None = None,
    ) -> None:
        self.sample_states = sample_states
        self.token_ids = token_ids
        self.emitted, self.rollback = emitted, rollback
        self._result = result
        # The model's last hidden states of every token the step computed, in the plan's row
        # order, where the runner keeps them (an MTP head reads them; the next step may
        # overwrite them).
        self.hidden_states = hidden_states
        self._copied: torch.cuda.Event | None = None
        # What the decode step after this one needs (a NextDecode), where the runner chains
        # them.
        self.next_decode = None
        if token_ids is not None:
            read = token_ids
            if emitted is not None:  # (each row's emitted tokens, then its refused count)
                rejected = rollback.num_rejected.to(torch.int64)
                read = torch.cat([emitted.tokens.flatten(), rejected])
            self._host_ids = read.to("cpu", non_blocking=True)  # pinned when on CUDA
            if read.is_cuda:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self._read = False

    @property
    def is_ready(self) -> bool:
        return self._result is not None

    @property
    def rows(self) -> dict[str, int]:
        """Each sampled request's row in ``token_ids``."""
        return {s.request_id: i for i, s in enumerate(self.sample_states)}

    def result(self) -> StepOutput:
        """The sampled tokens (waits for the device if they are still on their way).

        The first call appends them to their requests' states: steps are read in launch order,
        so a request's tokens arrive in order even when a step read at once follows one still
        in flight.
        """
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            ids = self._host_ids.tolist()
            request_ids = [s.request_id for s in self.sample_states]
            if self.emitted is None:
                self._result = StepOutput(request_ids, ids, [None] * len(ids))
            else:
                self._result = self._verified_output(request_ids, ids)
        if not self._read:
            self._read = True
            if self._result.num_accepted:
                for state, tokens in zip(self.sample_states, self._result.row_token_ids()):
                    state.all_token_ids += tokens
            else:
                for state, token_id in zip(self.sample_states, self._result.token_ids):
                    state.all_token_ids.append(token_id)
        return self._result

    def _verified_output(self, request_ids: list[str], ids: list[int]) -> StepOutput:
        """The output of a verification left on the device, from its one download (each row's
        emitted tokens, then each row's refused count)."""
        counts, width = self.emitted.counts, self.emitted.tokens.shape[1]
        rejected = ids[len(counts) * width :]
        accepted = [n - 1 - r for n, r in zip(counts, rejected)]
        tokens = [t for row in emitted_rows(ids, width, accepted) for t in row]
        return StepOutput(request_ids, tokens, [None] * len(counts), {}, accepted)


def emitted_rows(ids: list[int], width: int, accepted: list[int]) -> list[list[int]]:
    """Each row's emitted tokens (its accepted proposals and the token after them) out of a
    downloaded ``[rows, width]`` block of them (``ids``, flat)."""
    return [ids[i * width : i * width + 1 + a] for i, a in enumerate(accepted)]
