"""The pooling routes of an embedding model's server: ``/v1/embeddings`` through the official
openai client (floats, base64, token ids, ``dimensions``) against sentence-transformers,
``/pooling`` and ``/score`` over HTTP, and the refusals (each naming its field or the routes
the model serves)."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from openai_server import MAX_MODEL_LEN, MODEL_NAME, openai_client, start_server, stop_server
from tiny_models import CORPUS, save_embedding_model

TEXTS = CORPUS[:3]
MAX_INPUTS = 4


def assert_close(got, want) -> None:
    got, want = torch.as_tensor(got, dtype=torch.float32), torch.as_tensor(want)
    assert F.cosine_similarity(got, want, dim=-1).min() >= 0.9999
    assert (got - want).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """The server (auto-detected as pooling) and the sentence-transformers reference."""
    path, pipeline = save_embedding_model(tmp_path_factory.mktemp("embed"), "lasttoken", True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HERON_MAX_POOLING_INPUTS", str(MAX_INPUTS))
        handle = start_server(path, "--max-num-batched-tokens", "16")
    yield handle, pipeline
    stop_server(handle)


@pytest.fixture(scope="module")
def embed_http(embedder):
    with httpx.Client(base_url=embedder[0].base_url, timeout=60) as c:
        yield c


def test_embeddings_through_the_openai_client(embedder):
    handle, pipeline = embedder
    client = openai_client(handle)
    want = pipeline.encode(TEXTS, convert_to_tensor=True)
    # The client asks for base64 unless told otherwise, and decodes it.
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    assert_close([d.embedding for d in response.data], want)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert_close([d.embedding for d in floats.data], want)
    ids = [pipeline.tokenizer.encode(t) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids[0])
    assert_close(by_ids.data[0].embedding, want[0])
    short = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=16)
    assert_close(short.data[0].embedding, F.normalize(want[0, :16], dim=-1))


def test_pooling_and_score_routes(embedder, embed_http):
    http = embed_http
    _, pipeline = embedder
    want = pipeline.encode(TEXTS, convert_to_tensor=True)
    raw = http.post("/pooling", json={"model": MODEL_NAME, "input": TEXTS[:2]}).json()
    assert [d["index"] for d in raw["data"]] == [0, 1]
    assert_close(F.normalize(torch.tensor([d["data"] for d in raw["data"]]), dim=-1), want[:2])
    scored = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert_close([d["score"] for d in scored["data"]], want[1:] @ want[0])


@pytest.mark.parametrize(
    "route, body, param, message",
    [
        ("/v1/embeddings", {"input": []}, "input", "the input is empty"),
        ("/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}, "input", "more than one request"),
        ("/v1/embeddings", {"input": [1] * (MAX_MODEL_LEN + 1)}, "input", "context length"),
        ("/v1/embeddings", {"input": "a", "pooling_type": "mean"}, "pooling_type", "Extra"),
        ("/v1/embeddings", {"input": "a", "dimensions": 65}, "dimensions", "embedding size 64"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", None),
        ("/classify", {"input": "a"}, None, "it serves /v1/embeddings, /pooling"),
        ("/v1/completions", {"prompt": "a"}, None, "pooling model: it generates no text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, None, None),
    ],
)
def test_refusals_name_the_field_or_the_routes(embed_http, route, body, param, message):
    response = embed_http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message is None or message in error["message"]
