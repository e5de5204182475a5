"""Structured outputs: grammar specs (plain data), their compilation and per-request matchers."""

from heron.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
