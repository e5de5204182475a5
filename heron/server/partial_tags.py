"""Streaming text past tags that may arrive split over several deltas."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag``: what a stream
    holds back until the next delta tells whether the tag follows."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
