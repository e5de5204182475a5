"""Heron: an LLM inference and serving engine whose operators own their step metadata."""

from heron.llm import LLM
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import SamplingParams
from heron.structured import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
