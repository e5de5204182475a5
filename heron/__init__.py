"""Heron: an LLM inference and serving engine whose operators own their step metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

from heron.lora.request import LoRARequest
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import SamplingParams
from heron.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from heron.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ``LLM`` brings the whole model stack; a server front imports ``heron`` without it.
    if name == "LLM":
        from heron.llm import LLM

        return LLM
    raise AttributeError(f"module 'heron' has no attribute {name!r}")
