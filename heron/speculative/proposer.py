"""What the scheduler asks of a proposer that runs a model beside the target: a draft model,
or MTP heads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from heron.engine.request import Request
    from heron.execution.model_runner import LaunchedStep
    from heron.execution.step_plan import DeviceDrafts


class ModelProposer(ABC):
    """Proposes the next tokens by running a model with its own runner, plan and caches,
    batched over the requests that propose.

    The scheduler calls :meth:`propose` once per scheduling pass with the running requests in
    decode whose next step may verify proposals (their last token read); :meth:`reject` after
    a verification step refused some of a request's proposals (the request's
    ``num_computed_tokens`` already ends at its accepted prefix); :meth:`forget` when a request
    finishes, is aborted or is preempted (whatever the proposer holds for it goes back).
    Proposals are deterministic (greedy), so the rejection sampler's point-mass ``q`` holds.
    """

    #: Proposals per request and pass at most (``num_speculative_tokens``).
    num_tokens: int
    #: Whether :meth:`take_hidden_states` must be fed (MTP heads); a draft model needs none.
    wants_hidden_states: bool = False

    @abstractmethod
    def propose(
        self,
        requests: Sequence[Request],
        limits: Sequence[int],
        verifying: LaunchedStep | None = None,
    ) -> DeviceDrafts:
        """At most ``limits[i]`` (each at most ``num_tokens``) tokens to follow
        ``requests[i]``'s last token, in order, left on the device (row ``i`` of the
        result). With ``verifying`` (the target's verification still on the device; a draft
        model's only), a request with a row there proposes after that row's emitted tokens,
        which the host has not read."""

    @abstractmethod
    def reject(self, request: Request) -> None:
        """The target refused the request's proposals past its ``num_computed_tokens``."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: free what is kept for it."""

    def take_hidden_states(
        self,
        request_ids: Sequence[str],
        num_computed: Sequence[int],
        num_tokens: Sequence[int],
        hidden_states: torch.Tensor,
    ) -> None:
        """The target's last hidden states of every token a step computed, in its row order:
        ``num_tokens[i]`` consecutive rows of ``hidden_states`` for ``request_ids[i]``, at
        positions ``num_computed[i]`` on (a verification step's refused proposals included).
        Called right after the step is launched, only when ``wants_hidden_states``."""
