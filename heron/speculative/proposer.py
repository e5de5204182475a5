"""The one interface of the proposers (n-gram, draft model, MTP), and the engine's side of it:
which running requests propose how many tokens before each scheduling pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from heron.execution.sampler import on_device
from heron.execution.step_plan import DeviceDrafts

if TYPE_CHECKING:
    import torch

    from heron.engine.request import Request
    from heron.execution.launched import LaunchedStep


class Proposer(ABC):
    """Proposes the next tokens of running requests in decode, batched over the requests that
    propose.

    The engine calls :meth:`propose` (through :class:`Speculator`) once per step, before
    scheduling, with the running requests whose next step may verify proposals (their last
    token read); the scheduler calls :meth:`reject` after a verification step refused some of
    a request's proposals (the request's ``num_computed_tokens`` already ends at its accepted
    prefix) and :meth:`forget` when a request finishes, is aborted or is preempted (whatever
    the proposer holds for it goes back). Proposals are deterministic (greedy), so the
    rejection sampler's point-mass ``q`` holds.
    """

    #: Proposals per request and pass at most (``num_speculative_tokens``).
    num_tokens: int
    #: Whether :meth:`propose` leaves its proposals on the device (a model's: a
    #: :class:`DeviceDrafts`), rather than naming them on the host.
    proposes_on_device: bool = False
    #: Whether :meth:`take_hidden_states` must be fed (MTP heads).
    wants_hidden_states: bool = False

    @abstractmethod
    def propose(
        self,
        requests: Sequence[Request],
        limits: Sequence[int],
        verifying: LaunchedStep | None = None,
    ) -> list[list[int]] | DeviceDrafts:
        """At most ``limits[i]`` (each at most ``num_tokens``, at least 1) tokens to follow
        ``requests[i]``'s last token, in order (row ``i`` of the result). With ``verifying``
        (the target's verification still on the device; a draft model's only), a request
        with a row there proposes after that row's emitted tokens, which the host has not
        read."""

    def reject(self, request: Request) -> None:
        """The target refused the request's proposals past its ``num_computed_tokens``
        (nothing to do for a proposer that keeps no state of them)."""

    def settle(self) -> None:
        """Once no request runs: finish what is in flight and let go of the forgotten requests'
        state, so nothing holds the proposer's rows or device tensors (sleep mode)."""

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


class Speculator:
    """Before each scheduling pass, asks the :class:`Proposer` for the proposals of the
    running requests in decode that may verify some: none while more than ``propose_up_to``
    requests run, none for a request whose next token the verifier cannot sample or whose
    last token is still being sampled, none past the context, the step's token budget or
    ``max_tokens``.

    While at most ``uniform_up_to`` requests run, every proposing row is padded to
    ``num_tokens`` once any has a proposal, so verification steps are uniform (what
    verification graphs replay); a proposer that proposes on the device pads by proposing
    that many itself. Its proposals stay on the device where the target's runner takes them
    so (``drafts_on_device``: a single-rank one), else they are read here.
    """

    def __init__(
        self,
        proposer: Proposer,
        max_num_batched_tokens: int,
        max_model_len: int,
        propose_up_to: int,
        uniform_up_to: int,
        drafts_on_device: bool,
    ) -> None:
        self.proposer = proposer
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.propose_up_to = propose_up_to
        self.uniform_up_to = uniform_up_to
        self.drafts_on_device = drafts_on_device

    def proposes(self, num_running: int) -> bool:
        """Whether a pass over ``num_running`` requests makes proposals."""
        return num_running <= self.propose_up_to

    def propose(
        self, running: Sequence[Request], verifying: LaunchedStep | None
    ) -> dict[str, list[int]] | DeviceDrafts:
        """The running requests' proposals, for the scheduler: on the host by request, or left
        on the device. ``verifying``: the verification step still on the device that this
        pass runs past, as if it accepted every proposal (the pending tokens count so); its
        requests may propose again, from its emitted tokens."""
        if not self.proposes(len(running)):
            return {}
        verified = {} if verifying is None else verifying.rows
        budget = self.max_num_batched_tokens - 1
        k = self.proposer.num_tokens
        uniform = len(running) <= self.uniform_up_to
        on_device = self.drafts_on_device and self.proposer.proposes_on_device
        proposing, rooms, limits = [], [], []
        for request in running:
            # (a request whose pending tokens may end it is not scheduled)
            if request.num_tokens - request.num_computed_tokens == 1 and not (
                request.pending_tokens_end_it(self.max_model_len)
            ):
                room = self._verification_room(request, budget, verified)
                if room > 0:
                    proposing.append(request)
                    rooms.append(room)
                    if on_device and uniform:
                        limits.append(min(k, room))
                    else:
                        limits.append(min(k, _proposal_limit(request, room)))
        # (a model runs only for rows that may get a proposal)
        wanted = [i for i, limit in enumerate(limits) if limit > 0]
        made = self.proposer.propose(
            [proposing[i] for i in wanted], [limits[i] for i in wanted], verifying
        )
        if on_device:
            return made
        if isinstance(made, DeviceDrafts):
            made = made.to_lists()
        proposed: list[list[int]] = [[] for _ in proposing]
        for i, tokens in zip(wanted, made):
            proposed[i] = tokens
        if uniform and any(proposed):
            for request, room, tokens in zip(proposing, rooms, proposed):
                # any token does, as each is verified: the last one (text often repeats); past
                # max_tokens too (the tokens after the one that ends the request are dropped),
                # so that a request's last steps keep the query length of the graphs
                pad = (tokens or request.all_token_ids)[-1]
                tokens += [pad] * (min(k, room) - len(tokens))
        return {request.request_id: tokens for request, tokens in zip(proposing, proposed)}

    def _verification_room(self, request: Request, budget: int, verified: dict[str, int]) -> int:
        """How many tokens after its last one a decode step may compute for the request: none
        for a row the verifier cannot sample (logprobs, penalties, an unmet ``min_tokens``, a
        grammar) or whose last token is still being sampled (except by the verification this
        pass runs past, whose emitted tokens a model proposer takes on the device: requests in
        ``verified``); never past the context or the step's token budget."""
        pending = request.num_pending_tokens and request.request_id not in verified
        if pending or request.grammar is not None or not on_device(request):
            return 0
        return min(budget, self.max_model_len - request.num_tokens - 1)


def _proposal_limit(request: Request, room: int) -> int:
    """How many of a request's ``room`` tokens may be proposals: none past ``max_tokens``
    (counting the pending tokens as if all were accepted)."""
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:
        return room
    num_output = request.num_output_tokens + request.num_pending_tokens
    return min(room, max_tokens - num_output - 1)
