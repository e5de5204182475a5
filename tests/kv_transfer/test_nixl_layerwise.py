"""Layerwise transfer between two engines of one process (NIXL over UCX's TCP transport), as
the router drives it: both engines get the request at once with one transfer id; the decode
engine sends where the blocks go, the prefill engine WRITEs each layer as it is computed and
says when the prompt is complete. The decode engine then produces HF's greedy tokens (a dense
model, Gemma 3's window and full groups, DeepSeek-V3's latent cache; prompts in chunks that
end inside blocks, prefix hits on either side); writes start while later layers compute and
never before their layer was written; a decode side that never comes fails the prefill
request, a prefill side that goes silent mid-transfer is recomputed; nothing leaks."""

from __future__ import annotations

import threading
import time

import pytest
from test_nixl import _run
from test_offload import CONFIGS, MAX_NEW, PROMPTS, SMALL, check_leak_free, metric, models

from heron import SamplingParams
from heron.engine.llm_engine import LLMEngine

pytest.importorskip("nixl._api", reason="the nixl connector needs nixl (heron[pd])")

__all__ = ["models"]  # (the fixture, shared with the offload tests)

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Chunks of 12 tokens: every chunk but the first starts inside a block of 8.
CHUNKED = SMALL | dict(max_num_batched_tokens=12)


def _requests(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], transfer_id: str):
    """Add the request to both engines as the router does (the decode engine first)."""
    params = GREEDY.clone()
    params.kv_transfer_params = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        **prefill.scheduler.connector.handshake(),
    }
    decode.add_request(transfer_id, prompt, params)
    first = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id},
    )
    prefill.add_request(transfer_id, prompt, first)


def _step(engine: LLMEngine) -> list:
    """One pass of an engine's loop (as the core runs it)."""
    if engine.has_unfinished_requests():
        return engine.step()
    engine.release_blocks()
    return []


def _decoded(prefill: LLMEngine | None, decode: LLMEngine, timeout_s: float = 30):
    """Step both engines (the prefill one while given) until the decode engine's request
    ended: its tokens and final delta."""
    tokens, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for delta in decode.step():
            tokens += delta.samples[0].token_ids if delta.samples else []
            if delta.finished:
                return tokens, delta
        if prefill is not None:
            _step(prefill)
    raise AssertionError("the decode engine's request did not finish")


def _idle(*engines: LLMEngine) -> None:
    """Until the engines freed every block they hold for a transfer."""
    deadline = time.monotonic() + 10
    while any(e.has_unfinished_requests() or e.keeps_blocks() for e in engines):
        assert time.monotonic() < deadline, "an engine still holds blocks"
        for engine in engines:
            _step(engine)
        time.sleep(0.001)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_prefill_engine_writes_each_layer_to_the_decode_engine(
    models, family, monkeypatch, nixl_engine
):
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models(family)
    prefill, decode = (
        nixl_engine(path, "prefill", **CHUNKED),
        nixl_engine(path, "decode", **CHUNKED),
    )
    assert "layerwise" in prefill.scheduler.connector.describe()  # (the default)
    got, received = [], []
    # The fourth prompt shares 40 tokens (5 blocks) with the first: both engines hit them.
    # Then its first 41 tokens, whose 5 blocks before the last token the decode engine holds:
    # nothing is written (the prefill engine is told so), the decode engine computes the rest.
    for i, prompt in [(0, PROMPTS[0]), (1, PROMPTS[1]), (3, PROMPTS[3]), (4, PROMPTS[3][:41])]:
        _requests(prefill, decode, prompt, f"t{i}")
        tokens, delta = _decoded(prefill, decode)
        got.append(tokens)
        assert delta.num_cached_tokens == len(prompt) - 1  # all but the last
        received.append(metric(decode, "kv_transfer_blocks"))
        _idle(prefill, decode)
    assert got[:3] == [want[0], want[1], want[3]]
    assert received[0] >= 5 and received[1] >= 2 * received[0]  # (every block, once)
    assert received[3] == received[2]
    assert metric(prefill, "kv_transfer_blocks") == received[-1]  # written = received
    # (a block that a chunk ends inside is written again with the next chunk)
    assert metric(prefill, "kv_transfer_bytes") > metric(decode, "kv_transfer_bytes") > 0
    assert metric(decode, "kv_transfer_failed_loads") == 0
    check_leak_free(prefill)
    check_leak_free(decode)


def test_writes_start_while_later_layers_compute_and_never_before_their_layer(
    models, monkeypatch, nixl_engine
):
    """The prefill engine's first layer waits (after its layer step is recorded) until the
    saver described its WRITE: the saver WRITEs a layer's blocks once the count shows that
    layer written, never before, and the first while the step's later layers are to come."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models("llama")
    prefill, decode = nixl_engine(path, "prefill"), nixl_engine(path, "decode")
    runner, agent = prefill.runner, prefill.scheduler.connector.agent
    steps, owners, layers = runner.layer_steps, runner.cache.owners, agent.layers
    first_described = threading.Event()
    # (after the runner's hook, which records the layer step; a saver that waited for the
    # step's end would keep it waiting out the timeout, and the check below fails)
    owners[0].register_forward_hook(lambda *_: first_described.wait(30) and None)
    bases = []  # the count as each forward starts
    runner.model.register_forward_pre_hook(lambda *_: bases.append(steps.count))
    writes = []  # (layer, the count as its WRITE's blocks are described)
    describe = agent.agent.get_xfer_descs

    def recorded(descs, *args):
        layer = _layer_of(layers, descs[0][0]) if isinstance(descs, list) and descs else None
        if layer is not None:  # (the local side of a WRITE)
            writes.append((layer, steps.count))
            if layer == 0:
                first_described.set()
        return describe(descs, *args)

    monkeypatch.setattr(agent.agent, "get_xfer_descs", recorded)
    _requests(prefill, decode, PROMPTS[0], "t")
    tokens, _ = _decoded(prefill, decode)
    _idle(prefill, decode)
    assert tokens == want[0]
    assert len(bases) == 1  # (one step computes the prompt)
    assert sorted(layer for layer, _ in writes) == list(range(len(owners)))
    base = bases[0]
    assert all(count >= base + layer + 1 for layer, count in writes)  # never before
    assert min(count for layer, count in writes if layer == 0) < base + len(owners)
    check_leak_free(prefill)
    check_leak_free(decode)


def _layer_of(layers, address: int) -> int | None:
    """The cache layer whose region holds ``address`` (None: none of this engine's)."""
    for i, region in enumerate(layers):
        if (
            0
            <= address - region.address
            < region.num_prefixes * region.num_blocks * region.chunk_bytes
        ):
            return i
    return None


def test_a_long_prefill_outlasts_the_timeout_while_each_chunk_reports_progress(
    models, monkeypatch, nixl_engine
):
    """The decode engine's timeout bounds the wait between the prefill engine's steps, not the
    whole prompt: four chunks of 0.3 s each against a timeout of 0.6 s."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models("llama")
    prefill = nixl_engine(path, "prefill", **CHUNKED)
    decode = nixl_engine(path, "decode", dict(transfer_timeout_s=0.6))
    owners = prefill.runner.cache.owners
    for owner in owners:
        owner.register_forward_hook(lambda *_: time.sleep(0.3 / len(owners)))
    _requests(prefill, decode, PROMPTS[0], "t")
    started = time.monotonic()
    tokens, _ = _decoded(prefill, decode)
    assert time.monotonic() - started > 1.2
    assert tokens == want[0]
    _idle(prefill, decode)
    assert metric(decode, "kv_transfer_failed_loads") == 0
    check_leak_free(prefill)
    check_leak_free(decode)


def test_a_prefill_request_no_decode_engine_claims_fails_at_the_timeout(
    models, monkeypatch, nixl_engine
):
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, _ = models("llama")
    prefill = nixl_engine(path, "prefill", dict(hold_timeout_s=0.3))
    first = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "nobody"},
    )
    started = time.monotonic()
    tokens, delta = _run(prefill, PROMPTS[0], first)
    assert time.monotonic() - started >= 0.3
    assert tokens == [] and delta.samples[0].finish_reason == "abort"
    assert "no decode instance sent where its KV goes" in delta.error
    assert metric(prefill, "kv_transfer_hold_timeouts") == 1
    check_leak_free(prefill)


@pytest.mark.parametrize("policy", ["recompute", "abort"])
def test_a_prefill_engine_gone_mid_transfer_is_recomputed_or_fails(
    models, policy, monkeypatch, nixl_engine
):
    """The prefill engine computes its first chunk (its layers written to the decode engine),
    then stops: the decode engine gives the transfer up at its timeout (cancelled; nobody
    answers), frees its blocks after a second one, and computes the prompt itself, or fails
    the request."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models("llama")
    prefill = nixl_engine(path, "prefill", **CHUNKED)
    options = {"transfer_timeout_s": 0.5, "on_read_failure": policy}
    decode = nixl_engine(path, "decode", options)
    _requests(prefill, decode, PROMPTS[0], "t")
    while not prefill.scheduler.running:  # (until its destination came and it runs)
        _step(decode)
        _step(prefill)
    prefill.step()  # the first chunk, then nothing more
    started = time.monotonic()
    tokens, delta = _decoded(None, decode)
    assert time.monotonic() - started >= 0.5
    if policy == "recompute":
        assert tokens == want[0] and delta.error is None
    else:
        assert tokens == [] and "on_read_failure='abort'" in delta.error
    assert metric(decode, "kv_transfer_failed_loads") == 1
    assert metric(decode, "kv_transfer_blocks") == 0
    check_leak_free(decode)


def test_a_late_prefill_engine_is_cancelled_and_writes_nothing(
    models, monkeypatch, caplog, nixl_engine
):
    """The prefill engine sees the request only after the decode engine gave it up: it
    confirms the cancel at once (the decode engine frees its blocks then, not a second timeout
    later), fails its request and never writes into them."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models("llama")
    prefill = nixl_engine(path, "prefill")
    decode = nixl_engine(path, "decode", dict(transfer_timeout_s=0.3))
    _requests(prefill, decode, PROMPTS[0], "t")
    while "late; cancelled" not in caplog.text:
        decode.step()  # (the prefill engine is busy elsewhere)
    agent = prefill.scheduler.connector.agent
    while not agent.cancels:  # (the cancel has come when the prefill engine looks)
        agent.poll()
    started = time.monotonic()
    while decode.scheduler.loading:
        assert time.monotonic() - started < 0.3  # (confirmed, not timed out twice)
        for delta in _step(prefill):
            assert "the decode instance gave transfer 't' up" in delta.error
        assert decode.step() == []  # (nothing sampled before the load ended)
    tokens, _ = _decoded(prefill, decode)
    assert tokens == want[0]
    _idle(prefill, decode)
    assert metric(decode, "kv_transfer_failed_loads") == 1
    assert metric(prefill, "kv_transfer_blocks") == 0
    check_leak_free(prefill)
    check_leak_free(decode)


def test_a_whole_mode_instance_refuses_a_layerwise_request(models, monkeypatch, nixl_engine):
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, _ = models("llama")
    prefill = nixl_engine(path, "prefill", dict(kv_transfer_mode="whole"))
    assert prefill.scheduler.connector.handshake()["kv_transfer_mode"] == "whole"
    params = SamplingParams(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"}
    )
    with pytest.raises(ValueError, match="kv_transfer_mode is 'whole'"):
        prefill.add_request("r", PROMPTS[0], params)
