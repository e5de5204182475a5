"""The pooling routes of a reranker's server (a one-label Qwen3ForSequenceClassification):
``/score``, ``/rerank`` (and ``/v1/rerank``) and ``/classify`` over HTTP against HF's
sequence-classification logits, and the routes it refuses."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers as tf

from openai_server import MODEL_NAME, start_server, stop_server
from tiny_models import CORPUS, save_classifier

QUERY = "What is the capital of France?"
DOCUMENTS = CORPUS[:4]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """The server (auto-detected as pooling) and HF's scores of (QUERY, each document)."""
    path = save_classifier(tmp_path_factory.mktemp("reranker"), num_labels=1)
    hf = tf.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        pairs = [torch.tensor([tokenizer(QUERY, d)["input_ids"]]) for d in DOCUMENTS]
        logits = torch.stack([hf(ids).logits[0, 0] for ids in pairs])
        alone = hf(torch.tensor([tokenizer.encode(QUERY)])).logits[0, 0]
    handle = start_server(path)
    with httpx.Client(base_url=handle.base_url, timeout=60) as http:
        yield http, logits.sigmoid(), alone.sigmoid()
    stop_server(handle)


def test_score_equals_hf(reranker):
    http, want, _ = reranker
    body = http.post("/score", json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS})
    assert body.status_code == 200, body.text
    data = body.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCUMENTS)))
    torch.testing.assert_close(torch.tensor([d["score"] for d in data]), want, atol=1e-4, rtol=0)
    one = http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS[2]}).json()["data"]
    torch.testing.assert_close(one[0]["score"], want[2].item(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank"])
def test_rerank_orders_as_hf(reranker, route):
    http, want, _ = reranker
    order = want.argsort(descending=True).tolist()
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    results = http.post(route, json=body).json()["results"]
    assert [r["index"] for r in results] == order[:3]
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order[:3]]
    scores = torch.tensor([r["relevance_score"] for r in results])
    torch.testing.assert_close(scores, want[order[:3]], atol=1e-4, rtol=0)
    bare = http.post(route, json={**body, "top_n": None, "return_documents": False}).json()
    assert [r["index"] for r in bare["results"]] == order
    assert all("document" not in r for r in bare["results"])


def test_classify(reranker):
    http, _, alone = reranker
    (data,) = http.post("/classify", json={"input": QUERY}).json()["data"]
    assert data["label"] == "LABEL_0" and data["num_classes"] == 1
    torch.testing.assert_close(data["probs"][0], alone.item(), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "route, body, param, message",
    [
        ("/v1/embeddings", {"input": "a"}, None, "it serves /classify, /score, /rerank, /pooling"),
        ("/rerank", {"query": "a", "documents": []}, "documents", None),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n", None),
        ("/score", {"text_1": "a"}, "text_2", "Field required"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, None, None),
    ],
)
def test_refusals(reranker, route, body, param, message):
    response = reranker[0].post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message is None or message in error["message"]
