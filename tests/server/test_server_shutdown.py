"""SIGTERM during a stream: the stream ends with finish_reason "abort", a request arriving
then gets 503, and the server exits 0 and its engine core process with it."""

from __future__ import annotations

import json
import socket

import httpx

from openai_server import MODEL_NAME, child_pids, pid_exists, start_server, stop_server


def test_sigterm_during_stream(tiny_model_dir):
    """Also: a request whose body is still on its way when SIGTERM arrives (so uvicorn keeps its
    connection open) is answered 503 as soon as it is complete."""
    server = start_server(tiny_model_dir("qwen2"))
    (core,) = child_pids(server.proc.pid)
    body = {"model": MODEL_NAME, "prompt": "Paris", "max_tokens": 450, "stream": True}
    body["ignore_eos"] = True
    late = json.dumps({"model": MODEL_NAME, "prompt": "Paris", "max_tokens": 5}).encode()
    events = []
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as late_request:
            late_request.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(late), late[:5])
            )
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json=body, timeout=30
            ) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        server.proc.terminate()
            # The stream ended: the server has acted on the signal.
            late_request.sendall(late[5:])
            late_status = late_request.makefile("rb").readline().decode().strip()
    finally:
        code = stop_server(server)
    assert late_status == "HTTP/1.1 503 Service Unavailable"
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "abort"
    assert code == 0
    assert not pid_exists(core)
    with socket.socket() as s:  # the port was released: nothing listens on it any more
        # SO_REUSEADDR lets the bind ignore connections closed a moment ago and still in
        # TIME_WAIT on the port (which fail it now and then); a listening socket still fails it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
