"""Structured outputs: grammar specs (plain data), their compilation and per-request matchers."""

from heron.structured.params import ReasoningTokens, StructuredOutputsParams

__all__ = ["ReasoningTokens", "StructuredOutputsParams"]
