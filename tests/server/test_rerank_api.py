"""The pooling routes of a reranker's server (a one-label Qwen3ForSequenceClassification):
``/score``, ``/rerank`` (and ``/v1/rerank``) and ``/classify`` over HTTP against HF's
sequence-classification logits, and what it refuses (empty, too many and over-context inputs,
unknown parameters, generation routes), each naming its field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import transformers as tf

from openai_server import MAX_MODEL_LEN, MODEL_NAME, start_server, stop_server
from tiny_models import CORPUS, save_classifier

QUERY = "What is the capital of France?"
DOCUMENTS = CORPUS[:4]
MAX_INPUTS = 4
LONG = "a " * MAX_MODEL_LEN  # (a token a character at least)


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
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HERON_MAX_POOLING_INPUTS", str(MAX_INPUTS))
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
        ("/score", {"text_1": "a", "text_2": []}, "text_2", None),
        ("/rerank", {"query": "a", "documents": ["b"] * (MAX_INPUTS + 1)}, "documents", "more"),
        ("/rerank", {"query": "a", "documents": ["b", LONG]}, "documents", "context length"),
        ("/score", {"text_1": LONG, "text_2": "b"}, "text_2", "context length"),
        (
            "/rerank",
            {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 8},
            "truncate_prompt_tokens",
            None,
        ),
        ("/classify", {"input": "a", "activation": False}, "activation", "Extra"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, None, None),
    ],
)
def test_refusals(reranker, route, body, param, message):
    response = reranker[0].post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message is None or message in error["message"]


def test_refused_requests_leave_the_others_unaffected(reranker):
    """A rerank with one over-context document beside a good score request: the first is
    refused, the second answers as before."""
    http, want, _ = reranker

    def post(body):
        return http.post("/score" if "text_1" in body else "/rerank", json=body)

    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.map(
            post,
            [
                {"query": QUERY, "documents": [DOCUMENTS[0], LONG]},
                {"text_1": QUERY, "text_2": DOCUMENTS},
            ],
        )
    assert bad.status_code == 400 and good.status_code == 200, (bad.text, good.text)
    scores = torch.tensor([d["score"] for d in good.json()["data"]])
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=0)
