"""Prefill/decode disaggregation: a prefill and a decode `heron serve` (the nixl connector over
UCX's TCP transport on 127.0.0.1) behind `heron router`, whose first prefill URL is dead (every
request retries on the live one). Greedy answers through the router are the decode instance's
own answers without disaggregation, streamed or not, through the real openai client, with
the prefill instance writing each layer (kv_transfer_mode "layerwise", the default) or, from
a prefill instance of kv_transfer_mode "whole", the decode instance reading the prompt's
blocks; blocks nobody reads are freed at the timeout; a mismatched cache is refused; a failed
read is recomputed, or, on a third (decode) instance with on_read_failure "abort", answered
with the error; a client that leaves during the prefill aborts it on both sides. Neither side
keeps a block afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import httpx
import openai
import pytest
import uvicorn
from ports import free_port

from heron.cli import build_parser
from heron.server.router import Instances, make_app

from openai_server import (
    MODEL_NAME,
    child_pids,
    parse_metrics,
    start_server,
    stop_server,
)

pytest.importorskip("nixl._api", reason="the nixl connector needs nixl (heron[pd])")

HOLD_TIMEOUT_S = 2.0
# 50 tokens of the test tokenizer: more than one 16-token prefill chunk, blocks of 16.
PROMPT = "The quick brown fox jumps over the lazy dog, then runs far into the woods."
GREEDY = dict(model=MODEL_NAME, temperature=0.0, max_tokens=8)


def _nixl(role: str, **extra) -> str:
    options = {"hold_timeout_s": HOLD_TIMEOUT_S, "transfer_timeout_s": 10, **extra}
    return json.dumps(
        {"kv_connector": "nixl", "kv_role": role, "kv_connector_extra_config": options}
    )


@contextlib.contextmanager
def _router(prefill_urls: list[str], decode_urls: list[str]):
    """`heron router` in a thread of this process (as `heron router` runs it): its URL."""
    args = build_parser().parse_args(
        ["router", "--prefill", *prefill_urls, "--decode", *decode_urls]
        + ["--port", str(free_port())]
    )
    app = make_app(args.prefill, args.decode)
    router = uvicorn.Server(uvicorn.Config(app, args.host, args.port, log_level="warning"))
    thread = threading.Thread(target=router.run, daemon=True)
    thread.start()
    while not router.started:
        assert thread.is_alive()
        time.sleep(0.05)
    yield f"http://{args.host}:{args.port}"
    router.should_exit = True
    thread.join(10)


COMMON = ("--block-size", "16", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def pd(tiny_model_dir):
    """(prefill, decode, router URL, a decode instance that fails what it cannot read)."""
    model = tiny_model_dir("llama")
    failing = _nixl("decode", on_read_failure="abort", transfer_timeout_s=2)
    configs = [_nixl("prefill"), _nixl("decode"), failing]
    with mock.patch.dict(os.environ, {"UCX_TLS": "tcp"}), ThreadPoolExecutor(3) as pool:
        # (all start at once; a shared machine may take long)
        prefill, decode, failing = pool.map(
            lambda config: start_server(
                model, *COMMON, "--kv-transfer-config", config, startup_s=300
            ),
            configs,
        )
    dead = f"http://127.0.0.1:{free_port()}"
    with _router([dead, prefill.base_url], [decode.base_url]) as url:
        yield prefill, decode, url, failing
    for handle in (prefill, decode, failing):
        stop_server(handle)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _idle(handle) -> dict[str, float]:
    """Metrics once every block is free again (no request and no held block left)."""
    deadline = time.monotonic() + 10
    while True:
        m = parse_metrics(httpx.get(f"{handle.base_url}/metrics").text)
        if m["heron:kv_cache_free_blocks"] == m["heron:kv_cache_total_blocks"]:
            return m
        assert time.monotonic() < deadline, f"blocks still in use: {m}"
        time.sleep(0.05)


def test_router_answers_as_one_instance(pd):
    prefill, decode, url, _ = pd
    # (the reference is the prefill instance's: the decode one's prefix cache starts empty)
    direct, routed = _client(prefill.base_url), _client(url)
    before = _idle(decode)["heron:kv_transfer_blocks_total"]
    written = _idle(prefill)["heron:kv_transfer_blocks_total"]
    want = direct.completions.create(prompt=PROMPT, n=2, **GREEDY)
    got = routed.completions.create(prompt=PROMPT, n=2, **GREEDY)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert want.choices[0].text and got.usage == want.usage
    stream = routed.completions.create(prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    messages = [{"role": "user", "content": PROMPT}]
    want_chat = direct.chat.completions.create(messages=messages, **GREEDY)
    got_chat = routed.chat.completions.create(messages=messages, **GREEDY)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    stream = routed.chat.completions.create(messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want_chat.choices[0].message.content
    # Each prompt's first request reads every block of it (49 tokens: 4 blocks of 16), the
    # stream after it the last one (its full blocks hit the decode instance's prefix cache).
    m = _idle(decode)
    received = m["heron:kv_transfer_blocks_total"] - before
    assert received >= 2 * 4 + 2
    assert m["heron:kv_transfer_failed_loads_total"] == 0
    held = _idle(prefill)
    assert held["heron:kv_transfer_blocks_total"] - written == received  # (layerwise: written)
    assert held["heron:kv_transfer_held_blocks"] == 0
    assert held["heron:kv_transfer_hold_timeouts_total"] == 0


def test_a_whole_mode_prefill_instance_is_read_whole(pd, tiny_model_dir):
    """A prefill instance of kv_transfer_mode "whole" behind its own router: the router sends
    the request there first, the decode instance reads the blocks its answer names."""
    _, decode, *_ = pd
    config = _nixl("prefill", kv_transfer_mode="whole")
    with mock.patch.dict(os.environ, {"UCX_TLS": "tcp"}):
        whole = start_server(
            tiny_model_dir("llama"), *COMMON, "--kv-transfer-config", config, startup_s=300
        )
    try:
        assert httpx.get(f"{whole.base_url}/kv_transfer").json()["kv_transfer_mode"] == "whole"
        before = _idle(decode)["heron:kv_transfer_blocks_total"]
        prompt = "A whole prompt's blocks are read by the decode instance in one go."
        want = _client(whole.base_url).completions.create(prompt=prompt, **GREEDY)
        with _router([whole.base_url], [decode.base_url]) as url:
            got = _client(url).completions.create(prompt=prompt, **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        assert _idle(decode)["heron:kv_transfer_blocks_total"] > before
        m = _idle(whole)
        assert m["heron:kv_transfer_blocks_total"] == 0  # (read by the decode instance)
        assert m["heron:kv_transfer_held_blocks"] == 0
    finally:
        stop_server(whole)


def _prefilled(prefill, prompt: str = PROMPT) -> dict:
    answer = httpx.post(
        f"{prefill.base_url}/v1/completions",
        json={"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}, **GREEDY},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def test_blocks_no_decode_instance_reads_are_freed_at_the_timeout(pd):
    prefill, *_ = pd
    timeouts = _idle(prefill)["heron:kv_transfer_hold_timeouts_total"]
    _prefilled(prefill)
    m = parse_metrics(httpx.get(f"{prefill.base_url}/metrics").text)
    assert m["heron:kv_transfer_held_blocks"] >= 3
    assert m["heron:kv_cache_free_blocks"] < m["heron:kv_cache_total_blocks"]
    time.sleep(HOLD_TIMEOUT_S)
    m = _idle(prefill)
    assert m["heron:kv_transfer_hold_timeouts_total"] == timeouts + 1
    assert m["heron:kv_transfer_held_blocks"] == 0


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("remote_block_size", 32, "block_size \\(32\\) differs from this decode instance's"),
        ("remote_num_tokens", 3, "computed 3 prompt tokens"),
        ("do_remote_prefill", None, "missing: do_remote_prefill"),
    ],
)
def test_a_decode_instance_refuses_what_it_cannot_read(pd, field, value, error):
    prefill, decode, *_ = pd
    params = _prefilled(prefill) | {field: value}
    with pytest.raises(openai.BadRequestError, match=error):
        _client(decode.base_url).completions.create(
            prompt=PROMPT, extra_body={"kv_transfer_params": params}, **GREEDY
        )
    _idle(decode)


def test_a_failed_read_is_recomputed(pd):
    """A prefill instance gone (here: agent metadata nobody can reach) fails the read; the
    decode instance computes the prompt itself and answers right."""
    prefill, decode, *_ = pd
    client = _client(decode.base_url)
    want = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    failed = _idle(decode)["heron:kv_transfer_failed_loads_total"]
    params = _prefilled(prefill) | {"remote_engine_id": "gone", "remote_agent_metadata": "AAAA"}
    got = client.completions.create(
        prompt=PROMPT, extra_body={"kv_transfer_params": params}, **GREEDY
    )
    assert got.choices[0].text == want
    assert _idle(decode)["heron:kv_transfer_failed_loads_total"] == failed + 1


def test_a_client_that_disconnects_aborts_the_decode_request(pd):
    _, decode, url, _ = pd
    stream = _client(url).completions.create(
        prompt=PROMPT,
        stream=True,
        **(GREEDY | {"max_tokens": 400}),
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    m = _idle(decode)
    assert m["heron:num_requests_running"] == 0


ABORTED = 'heron:request_success_total{finished_reason="abort"}'


def test_a_client_that_disconnects_during_the_prefill_aborts_it(pd):
    """The client leaves while the prefill instance computes a long prompt: the router closes
    its requests, both instances abort them (nothing held until the timeout), and nothing
    reaches the decode instance's cache."""
    prefill, decode, url, _ = pd
    before, decoding = _idle(prefill), _idle(decode)
    body = json.dumps({"prompt": PROMPT * 8, "stream": True, **GREEDY}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 30
        while not parse_metrics(httpx.get(f"{prefill.base_url}/metrics").text)[
            "heron:num_requests_running"
        ]:
            assert time.monotonic() < deadline, "the prefill instance never ran the request"
            time.sleep(0.01)
    after = _idle(prefill)
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    assert (
        after["heron:kv_transfer_hold_timeouts_total"]
        == (before["heron:kv_transfer_hold_timeouts_total"])
    )
    after = _idle(decode)
    assert after[ABORTED] == decoding.get(ABORTED, 0) + 1
    assert after["heron:kv_transfer_blocks_total"] == decoding["heron:kv_transfer_blocks_total"]


def test_a_decode_instance_that_fails_reads_answers_with_an_error(pd):
    """(on_read_failure "abort") A read that fails ends the request at once with an error
    naming why, streamed or not; nothing is left on the decode instance."""
    prefill, *_, failing = pd
    params = _prefilled(prefill) | {"remote_engine_id": "gone", "remote_agent_metadata": "AAAA"}
    client = _client(failing.base_url)
    error = "the KV read from the prefill instance failed.*on_read_failure='abort'"
    with pytest.raises(openai.InternalServerError, match=error):
        client.completions.create(
            prompt=PROMPT, extra_body={"kv_transfer_params": params}, **GREEDY
        )
    with pytest.raises(openai.APIError, match=error):
        stream = client.completions.create(
            prompt=PROMPT, stream=True, extra_body={"kv_transfer_params": params}, **GREEDY
        )
        list(stream)
    m = _idle(failing)
    assert m["heron:kv_transfer_failed_loads_total"] == 2
    assert m["heron:num_requests_running"] == 0


def test_a_prefill_instance_that_died_is_recomputed(pd):
    """(last: it kills the module's prefill instance, in the middle of a layerwise transfer
    to the instance that fails what it cannot get: that request fails once no progress came
    within its timeout) A read from a prefill instance gone after its answer fails or times
    out; the decode instance computes the prompt itself, the one that fails such reads answers
    with the error."""
    prefill, decode, _, failing = pd
    prompt = "Every cache block that a gone instance held is recomputed by the one that reads."
    want = _client(prefill.base_url).completions.create(prompt=prompt, **GREEDY).choices[0].text
    params = _prefilled(prefill, prompt)
    handshake = httpx.get(f"{prefill.base_url}/kv_transfer").json()
    layerwise = {"transfer_id": "killed", "do_remote_prefill": True, **handshake}
    first = {"do_remote_decode": True, "transfer_id": "killed"}
    with ThreadPoolExecutor(2) as pool:
        cut = pool.submit(
            _client(failing.base_url).completions.create,
            prompt=PROMPT * 8,
            extra_body={"kv_transfer_params": layerwise},
            **GREEDY,
        )
        pool.submit(
            httpx.post,
            f"{prefill.base_url}/v1/completions",
            json={"prompt": PROMPT * 8, "kv_transfer_params": first, **GREEDY, "max_tokens": 1},
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not parse_metrics(httpx.get(f"{prefill.base_url}/metrics").text)[
            "heron:num_requests_running"
        ]:  # (its destination came: it computes and writes)
            assert time.monotonic() < deadline, "the prefill instance never ran the request"
            time.sleep(0.01)
        for pid in [*child_pids(prefill.proc.pid), prefill.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        prefill.proc.wait(10)
        with pytest.raises(openai.InternalServerError, match="on_read_failure='abort'"):
            cut.result()
    failed = _idle(decode)["heron:kv_transfer_failed_loads_total"]
    with ThreadPoolExecutor(2) as pool:
        answers = [
            pool.submit(
                _client(handle.base_url).completions.create,
                prompt=prompt,
                extra_body={"kv_transfer_params": params},
                **GREEDY,
            )
            for handle in (decode, failing)
        ]
        got = answers[0].result()
        with pytest.raises(openai.InternalServerError, match="on_read_failure='abort'"):
            answers[1].result()
    assert got.choices[0].text == want
    _idle(failing)
    assert _idle(decode)["heron:kv_transfer_failed_loads_total"] == failed + 1


def test_the_router_picks_the_least_loaded_instance():
    instances = Instances("decode", ["http://a/", "http://b"])
    assert instances.by_load() == ["http://a", "http://b"]  # ties: the order given
    with instances.use("http://a"):
        assert instances.by_load()[0] == "http://b"
    assert instances.outstanding == {"http://a": 0, "http://b": 0}
    with pytest.raises(ValueError, match="--prefill: give at least one instance URL"):
        Instances("prefill", [])
