"""Speculative decoding: proposals of the next tokens, verified by the target model in one step."""

from heron.speculative.ngram import NgramProposer
from heron.speculative.proposer import Proposer, Speculator
from heron.speculative.stats import SpecDecodeStats

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "Speculator"]
