"""Verification of proposals: greedy acceptance exact; rejection sampling emits the target's
distribution at every position (chi-square over a small vocabulary); seeded rows reproducible."""

import pytest
import torch

from heron.execution.request_state import RequestState
from heron.execution.step_plan import NewRequest
from heron.execution.verify import accept_greedy, verify
from heron.sampling_params import SamplingParams

VOCAB = 6


def states(n: int, params: SamplingParams, seed: int | None = None) -> list[RequestState]:
    return [
        RequestState(NewRequest(str(i), [0], 1, params, seed), torch.device("cpu"))
        for i in range(n)
    ]


def test_greedy_accepts_while_proposals_are_the_argmax():
    logits = torch.full((4 + 3, VOCAB), -1.0)
    for row, token in enumerate([2, 3, 1, 5, 4, 4, 0]):
        logits[row, token] = 1.0
    # request 0 verifies [2, 3, 9->1?]: rows 0..3; request 1 verifies [4, 1]: rows 4..6
    out = verify(logits, states(2, SamplingParams(temperature=0)), [[2, 3, 4], [4, 1]], None)
    assert out == [[2, 3, 1], [4, 4]]  # a mismatch emits the target's token and stops
    out = verify(logits, states(2, SamplingParams(temperature=0)), [[2, 3, 1], [0, 1]], None)
    assert out == [[2, 3, 1, 5], [4]]  # all accepted: the last row's token follows


def test_host_greedy_acceptance_matches_verify():
    """The runner's host path (the step's argmax downloaded once) accepts what ``verify``
    accepts on the logits."""
    torch.manual_seed(0)
    logits = torch.randn(4 + 3 + 1, VOCAB)
    targets = logits.argmax(-1).tolist()
    proposals = [[targets[0], targets[1], (targets[2] + 1) % VOCAB], [targets[4], targets[5]], []]
    params = SamplingParams(temperature=0)
    want = verify(logits, states(3, params), proposals, None)
    assert accept_greedy(proposals, targets) == want
    assert want == [[targets[0], targets[1], targets[2]], [*targets[4:7]], [targets[7]]]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
    ids=["t1", "t0.7-top4"],
)
def test_sampled_tokens_follow_the_target_distribution(params):
    torch.manual_seed(0)
    position_logits = torch.randn(3, VOCAB) * 1.5
    # the second most likely token, then the most likely: both refused often enough to test
    # the draws after a refusal, accepted often enough to test the positions after them
    proposals = [int(position_logits[0].topk(2).indices[1]), int(position_logits[1].argmax())]
    n = 30000
    logits = position_logits.repeat(n, 1)
    out = verify(logits, states(n, params), [proposals] * n, torch.Generator().manual_seed(1))
    target = []
    for row in position_logits:
        scaled = row / params.temperature
        if params.top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], -torch.inf)
        target.append(scaled.softmax(-1))
    # position i's token, among the runs that accepted every proposal before it
    for i in range(3):
        tokens = torch.tensor([o[i] for o in out if len(o) > i and o[:i] == proposals[:i]])
        assert len(tokens) > 500, f"too few runs reach position {i}"
        counts = torch.bincount(tokens, minlength=VOCAB).double()
        assert chi_square_p_value(counts, target[i].double()) > 1e-4, (i, counts)


def test_a_seeded_row_depends_only_on_its_seed():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(temperature=1.0)
    runs = [
        verify(logits, states(1, params, seed=7), [[1, 2]], torch.Generator().manual_seed(g))
        for g in range(5)
    ]
    assert all(r == runs[0] for r in runs)
    both = verify(
        torch.cat([torch.randn(2, VOCAB), logits]),
        states(1, params) + states(1, params, seed=7),
        [[3], [1, 2]],
        torch.Generator().manual_seed(9),
    )
    assert both[1] == runs[0][0]
    draws = {tuple(verify(logits, states(1, params, seed=s), [[1, 2]], None)[0]) for s in range(40)}
    assert len(draws) > 1  # the seed matters
