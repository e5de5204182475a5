"""The OpenAI API of a running server, through the official client and raw HTTP."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from heron import LLM, SamplingParams

from openai_server import MAX_MODEL_LEN, MODEL_NAME

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Where is Paris?"}]


def test_completion_matches_offline_llm(client, server):
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0
    )
    llm = LLM(str(server.model_dir), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    choice = response.choices[0]
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == MODEL_NAME
    assert choice.text == expected[0].outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10


def test_chat_and_chat_stream(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_n_seed_and_stop(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs, n=2)
    second = client.completions.create(**kwargs, n=2)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    stop = greedy.choices[0].text[3:5]
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(stop)]


def test_multiple_prompts(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Paris"], max_tokens=3, temperature=0, n=2
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 12
    tokens = client.completions.create(
        model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, echo=True
    )
    assert tokens.usage.prompt_tokens == 5 and len(tokens.choices) == 2


def test_logprobs(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)


def test_models_tokenize_version(http):
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == PROMPT
    assert http.get("/version").json()["version"]


@pytest.mark.parametrize("route", ["/v1/embeddings", "/rerank"])
def test_pooling_routes_name_the_generation_routes(http, route):
    """A generating model's server refuses the pooling routes (a pooling model's server is
    tests/server/test_embeddings_api.py)."""
    body = {"input": "a"} if route == "/v1/embeddings" else {"query": "a", "documents": ["b"]}
    error = _error(http.post(route, json=body), 400)
    assert "generates text: use /v1/completions" in error["message"]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 0}, 400, "n"),
        ({"top_p": 2}, 400, "top_p"),
        ({"max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "fox " * (2 * MAX_MODEL_LEN)}, 400, None),
        ({"model": "gpt-nope"}, 404, "model"),
    ],
)
def test_bad_requests_get_4xx_while_others_run(client, http, body, status, param):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(
            client.completions.create, model=MODEL_NAME, prompt=PROMPT, max_tokens=30
        )
        error = _error(
            http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **body}),
            status,
        )
        assert error["param"] == param
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert good.result().choices[0].finish_reason in ("length", "stop")
    if "prompt" in body:
        assert "max_model_len=512" in error["message"] and "tokens" in error["message"]


def test_malformed_json_unknown_route_and_auth(http, server):
    bad_json = http.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    _error(bad_json, 400)
    _error(http.get("/v1/nope"), 404)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": PROMPT}, headers=headers
        )
        assert _error(response, 401)["code"] == "invalid_api_key"
    # Health and metrics stay open without a key.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_chat_stream_with_two_samples_and_logprobs(client):
    """Streamed chat with n=2: each choice opens with the role, texts equal the non-streamed
    ones (seeded), and every streamed token carries its logprob entry."""
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    texts, roles, logprobs = {0: "", 1: ""}, set(), {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprobs[choice.index] += choice.logprobs.content
    assert roles == {0, 1}
    for choice in full.choices:
        assert texts[choice.index] == choice.message.content
        streamed = [(e.token, round(e.logprob, 4)) for e in logprobs[choice.index]]
        whole = [(e.token, round(e.logprob, 4)) for e in choice.logprobs.content]
        assert streamed == whole and len(whole) == 8
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
