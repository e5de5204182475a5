"""Request and response bodies of the pooling routes: ``/v1/embeddings`` (OpenAI's schema),
``/pooling``, ``/classify``, ``/score`` and ``/rerank`` (vLLM's, and Jina's for rerank).

Unknown fields are refused by name (``extra="forbid"``): a pooling parameter this server does
not know must not be ignored.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from heron.outputs import PoolingRequestOutput
from heron.server.protocol import NullIsUnset, PositiveInt, TokenId

# One input, or several: texts or token ids.
PoolingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class PoolingBody(NullIsUnset):
    """What every pooling route's body has."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    user: str | None = None  # OpenAI's identity field: accepted, it changes nothing


class _InputRequest(PoolingBody):
    input: PoolingInput

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if not value:
            raise ValueError("the input is empty")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The input field as a list of inputs (text or token ids)."""
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


class EmbeddingRequest(_InputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None


class PoolingRequest(_InputRequest):
    """The model's pooled output as it is (a reward model's reward)."""


class ClassificationRequest(_InputRequest):
    """A classifier's labels and probabilities."""


class ScoreRequest(PoolingBody):
    """vLLM's: ``text_1`` against each of ``text_2``."""

    text_1: str
    text_2: str | list[str] = Field(min_length=1)

    def documents(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else self.text_2


class RerankRequest(PoolingBody):
    """Jina's (and vLLM's): ``documents`` ordered by relevance to ``query``."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: PositiveInt | None = None
    return_documents: bool = True


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


def usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def embeddings_response(
    outputs: list[PoolingRequestOutput], model: str, encoding_format: str
) -> dict[str, Any]:
    """OpenAI's embeddings list; base64 is the float32 little-endian bytes, as OpenAI's."""
    data = []
    for i, output in enumerate(outputs):
        embedding: list[float] | str = output.data
        if encoding_format == "base64":
            packed = struct.pack(f"<{len(output.data)}f", *output.data)
            embedding = base64.b64encode(packed).decode()
        data.append({"object": "embedding", "embedding": embedding, "index": i})
    return {"object": "list", "data": data, "model": model, "usage": usage(outputs).model_dump()}


def _list_response(request_id: str, model: str, data: list, outputs) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(outputs).model_dump(),
    }


def pooling_response(request_id: str, model: str, outputs: list[PoolingRequestOutput]) -> dict:
    data = [{"index": i, "object": "pooling", "data": o.data} for i, o in enumerate(outputs)]
    return _list_response(request_id, model, data, outputs)


def classification_response(
    request_id: str, model: str, outputs: list[PoolingRequestOutput], labels: tuple[str, ...]
) -> dict:
    data = []
    for i, output in enumerate(outputs):
        best = max(range(len(output.data)), key=output.data.__getitem__)
        data.append(
            {
                "index": i,
                "label": labels[best],
                "probs": output.data,
                "num_classes": len(output.data),
            }
        )
    return _list_response(request_id, model, data, outputs)


def score_response(
    request_id: str, model: str, scores: list[float], outputs: list[PoolingRequestOutput]
) -> dict:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return _list_response(request_id, model, data, outputs)


def rerank_response(
    request_id: str,
    model: str,
    body: RerankRequest,
    scores: list[float],
    outputs: list[PoolingRequestOutput],
) -> dict:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return {
        "id": request_id,
        "model": model,
        "usage": {"total_tokens": usage(outputs).total_tokens},
        "results": results,
    }
