"""What a hostile or careless client sends: every field that would change the result is honoured
or refused by name, bad values are 400s with OpenAI's error body, large bodies neither pass the
limit nor stall other clients; through the real openai client and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
from collections.abc import Iterable

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from openai_server import API_KEY, MAX_MODEL_LEN, MODEL_NAME

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Where is Paris?"}]
BODY_LIMIT = 16 << 20  # the server's default
JSON = {"Content-Type": "application/json"}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_seed_torch_cannot_take_fails_only_its_request(client):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(
            client.completions.create, model=MODEL_NAME, prompt=PROMPT, max_tokens=20
        )
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=2**64)
        assert e.value.body["param"] == "seed"
        assert other.result().choices[0].finish_reason in ("length", "stop")


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("completions", {"suffix": "!"}, "suffix"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"best_of": 3}, "best_of"),
        ("chat", {"logit_bias": {"100000": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
        # (structured outputs are implemented; these vLLM extras are not, and tools only in chat)
        ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_fields_that_change_the_result_are_refused_by_name(client, route, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body=extra
            )
        else:
            client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body=extra
            )
    assert e.value.body["param"] == param
    assert param in e.value.body["message"]


def test_logit_bias(client, http):
    """+100 makes a token certain, whatever the model says."""
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"5": 100}
    )
    want = http.post("/detokenize", json={"tokens": [5] * 4}).json()["prompt"]
    assert response.choices[0].text == want


def test_image_parts_are_refused_by_a_text_only_model(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "What is this?"}, image]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert "text-only model: it takes no images" in e.value.body["message"]


def test_harmless_fields_and_best_of_equal_to_n_are_accepted(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=2,
        n=2,
        best_of=2,
        user="someone",
        extra_body={"metadata": {"team": "a"}},
    )
    assert len(response.choices) == 2


def test_chat_template_of_the_request_is_used(client, http, server):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    want = tokenizer.encode("<user>Where is Paris?", add_special_tokens=False)
    tokenized = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": template})
    assert tokenized.json()["tokens"] == want
    kwargs = dict(model=MODEL_NAME, max_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        messages=MESSAGES, extra_body={"chat_template": template}, **kwargs
    )
    completion = client.completions.create(prompt=want, **kwargs)
    assert chat.choices[0].message.content == completion.choices[0].text
    with_variables = {
        "messages": MESSAGES,
        "chat_template": "{{ greeting }}" + template,
        "chat_template_kwargs": {"greeting": "Hello "},
    }
    greeted = http.post("/tokenize", json=with_variables).json()["tokens"]
    assert greeted == tokenizer.encode("Hello <user>Where is Paris?", add_special_tokens=False)
    reserved = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}, "max_tokens": 2},
    )
    assert _error(reserved, 400)["param"] == "chat_template_kwargs"
    broken = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "chat_template": "{% for %}", "max_tokens": 2},
    )
    assert _error(broken, 400)["param"] == "chat_template"


def test_max_tokens_beyond_the_context(client, http):
    num_prompt = len(http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    message = e.value.body["message"]
    assert e.value.body["param"] == "max_tokens"
    assert f"max_tokens={MAX_MODEL_LEN}" in message and f"{num_prompt} tokens" in message
    assert f"max_model_len={MAX_MODEL_LEN}" in message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=MAX_MODEL_LEN
        )
    assert e.value.body["param"] == "max_completion_tokens"
    huge = _error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2**70}), 400)
    assert huge["param"] == "max_tokens"
    # Exactly up to the context is accepted (streamed and left after the first chunk).
    fits = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_MODEL_LEN - num_prompt, stream=True
    )
    with fits:
        assert next(iter(fits)).choices


@pytest.mark.parametrize("route", ["/v1/completions", "/tokenize"])
def test_lone_surrogates_are_a_400(http, route):
    body = b'{"prompt": "fox \\ud800 jumps", "max_tokens": 2}'
    error = _error(http.post(route, content=body, headers=JSON), 400)
    assert error["code"] == "invalid_json" and "escape" in error["message"]


@pytest.mark.parametrize("tokens, bad", [([5, -1], -1), ([2**40], 2**40), ([2**70], 2**70)])
def test_detokenize_bad_ids(http, tokens, bad):
    error = _error(http.post("/detokenize", json={"tokens": tokens}), 400)
    assert error["param"] == "tokens" and str(bad) in error["message"]


@pytest.mark.parametrize("prompt", [[], [[]], ""])
def test_empty_prompt(http, prompt):
    error = _error(http.post("/v1/completions", json={"prompt": prompt}), 400)
    assert "empty" in error["message"]


def test_streams_with_n_carry_one_choice_per_chunk(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=5, temperature=1.0, seed=3, n=3, stream=True)
    completion = list(client.completions.create(prompt=[PROMPT, "Paris"], **kwargs))
    chat = list(client.chat.completions.create(messages=MESSAGES, **kwargs))
    for chunks, indices in ((completion, set(range(6))), (chat, set(range(3)))):
        assert all(len(c.choices) == 1 for c in chunks)
        assert {c.choices[0].index for c in chunks} == indices


def test_echo_with_logprobs_covers_the_prompt(client, http):
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    plain = client.completions.create(**kwargs).choices[0]
    lp = echoed.logprobs
    assert echoed.text == PROMPT + plain.text
    assert len(lp.tokens) == len(prompt_ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[len(prompt_ids) :] == pytest.approx(plain.logprobs.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(echo=True, stream=True, **kwargs))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def _raw_post(server, headers: dict[str, str], body: Iterable[bytes] = ()) -> str:
    """POST /v1/completions over a plain socket (httpx will not send a body shorter than its
    Content-Length); returns the status line. Every byte sent is one the server reads, so it
    closes the connection cleanly after answering."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        for part in body:
            s.sendall(part)
        return s.makefile("rb").readline().decode().strip()


def test_prompt_logprobs_equal_hf_log_softmax(client, server):
    """vLLM's prompt_logprobs: per prompt token (the first None) its own logprob and rank and
    the top-N, against HF transformers' log-softmax of the prompt's logits."""
    prompt = [7, 8, 9, 10, 11, 12]
    kwargs = dict(model=MODEL_NAME, max_tokens=2, temperature=0)
    completion = client.completions.create(
        prompt=prompt, extra_body={"prompt_logprobs": 2}, **kwargs
    )
    got = completion.choices[0].prompt_logprobs
    hf = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert got[0] is None and len(got) == len(prompt)
    for position, entry in enumerate(got[1:], start=1):
        row, token = ref[position - 1], prompt[position]
        want_top = row.topk(2).indices.tolist()
        assert set(entry) == {str(t) for t in [token, *want_top]}
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert [entry[str(t)]["rank"] for t in want_top if t != token] == [
            r for r, t in enumerate(want_top, start=1) if t != token
        ]
    chat = client.chat.completions.create(
        messages=MESSAGES, extra_body={"prompt_logprobs": 0}, **kwargs
    )
    assert chat.prompt_logprobs[0] is None
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in chat.prompt_logprobs[1:])


def test_api_key_is_checked_before_the_body(server):
    # Invalid JSON, and a declared length over the limit: the missing key is what is reported.
    assert httpx.post(f"{server.base_url}/v1/completions", content=b"{x").status_code == 401
    status = _raw_post(server, {"Content-Length": str(BODY_LIMIT + 1)})
    assert status == "HTTP/1.1 401 Unauthorized"


def test_bodies_over_the_limit_are_413(server):
    auth = {"Authorization": f"Bearer {API_KEY}", **JSON}
    declared = _raw_post(server, {**auth, "Content-Length": str(BODY_LIMIT + 1)})
    assert declared == "HTTP/1.1 413 Request Entity Too Large"
    # Without a Content-Length the limit holds while the body is read: one chunk past it.
    chunk = b" " * (BODY_LIMIT + 1)
    chunked = [b"%x\r\n" % len(chunk), chunk, b"\r\n"]
    status = _raw_post(server, {**auth, "Transfer-Encoding": "chunked"}, chunked)
    assert status == "HTTP/1.1 413 Request Entity Too Large"


def test_a_text_longer_than_the_context_can_hold_is_refused_untokenized(http):
    error = _error(http.post("/v1/completions", json={"prompt": "fox " * (10 << 18)}), 400)
    assert f"has {40 << 18} characters" in error["message"]
    assert f"max_model_len={MAX_MODEL_LEN}" in error["message"]


def test_health_answers_while_a_large_body_is_processed(server, http):
    """A 10 MB body is parsed, and its prompts tokenized, off the event loop: a /health request
    sent once the whole body is out is answered while the large request is still in work."""
    prompts = ["fox " * 750] * 100  # each fits in characters, not in tokens
    filler = "x" * (10 << 20)  # a field without effect on the output
    body = json.dumps({"prompt": prompts, "max_tokens": 2, "user": filler}).encode()
    order: list[str] = []
    health_sent = threading.Event()

    def body_then_health():
        yield body
        # The body is out: from here on the server parses and tokenizes it.
        health_sent.set()

    def big() -> httpx.Response:
        response = http.post("/v1/completions", content=body_then_health(), headers=JSON)
        order.append("big")
        return response

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        large = pool.submit(big)
        health_sent.wait()
        assert httpx.get(f"{server.base_url}/health", timeout=60).status_code == 200
        order.append("health")
        error = _error(large.result(), 400)
    assert order == ["health", "big"]
    assert f"max_model_len={MAX_MODEL_LEN}" in error["message"]
