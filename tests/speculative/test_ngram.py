"""Prompt lookup against a plain search written from its definition."""

import random

import pytest

from heron.speculative import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (max_n down to min_n) with an earlier occurrence: what followed the
    latest such occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_equals_the_plain_search(min_n, max_n):
    rng = random.Random(0)
    proposer = NgramProposer(4, min_n, max_n)
    for i in range(200):
        vocab = rng.choice([3, 6, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        assert proposer.lookup(str(i), tokens, 4) == reference(tokens, 4, min_n, max_n), tokens
        # the same request grown by some tokens: its kept array follows
        for _ in range(3):
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            assert proposer.lookup(str(i), tokens, 4) == reference(tokens, 4, min_n, max_n)


def test_limit_and_repeats():
    proposer = NgramProposer(5, 2, 3)
    text = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert proposer.lookup("a", text, 10) == [4, 5, 6, 7, 1]
    assert proposer.lookup("a", text, 2) == [4, 5]
    assert proposer.lookup("a", text, 0) == []
    assert proposer.lookup("b", [1, 2, 3, 9], 5) == []  # no earlier 2-gram suffix
    proposer.forget("a")
    assert proposer.lookup("a", [7, 8, 7], 5) == []  # a new sequence under a reused id
