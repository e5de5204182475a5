"""Host-memory offload against HF transformers: a device pool of a few requests evicts every
prefix, the host tier serves it back, and the tokens stay HF's greedy ones (a dense model,
Gemma 3's window and full groups, DeepSeek-V3's latent cache, Qwen3.5's state checkpoints).
Failing connectors recompute; a layerwise saver waits on the layer step counter."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import msgspec
import pytest
import torch
import transformers as tf
from execution.view_replay import ViewReplay

from heron import SamplingParams
from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine
from heron.engine.messages import EngineStats
from heron.kv_transfer import KVTransferError
from heron.kv_transfer.offload import OffloadScheduler, OffloadWorker
from heron.server.metrics import ServerMetrics

from tiny_models import BASE, DEEPSEEK, QWEN3_5, hf_greedy, save_random_model, tiny_config

BLOCK = 8
MAX_NEW = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Three 40-token prefixes (5 blocks each), visited twice: an 8-block pool holds one
# request, so each prefix has left the device when it comes back.
_GEN = torch.Generator().manual_seed(0)
PREFIXES = [torch.randint(1, 300, (40,), generator=_GEN).tolist() for _ in range(3)]
PROMPTS = [p + [7 + turn, 9] for turn in range(2) for p in PREFIXES]
POISON = 12345.0  # what every cache holds before a layer writes it
SMALL = dict(num_kv_blocks=9, block_size=BLOCK, max_model_len=64, max_num_seqs=2)


def _gemma3() -> tf.PretrainedConfig:
    return tf.Gemma3TextConfig(
        **{k: v for k, v in BASE.items() if k != "num_hidden_layers"},
        num_hidden_layers=2,
        head_dim=16,
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    )


def _deepseek_v3() -> tf.PretrainedConfig:
    return tf.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, n_shared_experts=1, num_mtp_layers=0)


# The paged kinds (what every connector moves), then with a recurrent group beside them.
CONFIGS = {"llama": lambda: tiny_config("llama"), "gemma3": _gemma3, "deepseek_v3": _deepseek_v3}
FAMILIES = CONFIGS | {"qwen3_5": lambda: tf.Qwen3_5TextConfig(**QWEN3_5)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Factory: a family's saved tiny model and HF's greedy tokens for ``PROMPTS``."""
    cache = {}

    def get(family: str):
        if family not in cache:
            path = save_random_model(FAMILIES[family](), tmp_path_factory.mktemp(family))
            hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            cache[family] = path, hf_greedy(hf, PROMPTS, MAX_NEW)
        return cache[family]

    return get


class CheckedOffload(OffloadScheduler):
    """The offload connector with its invariants checked after every public operation."""


def _checked(name: str):
    def method(self, *args):
        result = getattr(super(CheckedOffload, self), name)(*args)
        self.check_invariants()
        return result

    return method


for _name in (
    "lookup",
    "load",
    "scheduled",
    "freed",
    "checkpointed",
    "timed_out",
    "forget",
    "finished",
    "take_step_meta",
):
    setattr(CheckedOffload, _name, _checked(_name))


def run_one_by_one(engine: LLMEngine, prompts=PROMPTS) -> list[tuple[list[int], int]]:
    """Each prompt's tokens and cached prompt tokens, run to its end one after the other,
    every invariant checked after every step and every operation of the connector."""
    connector = engine.scheduler.connector
    if type(connector) is OffloadScheduler:  # (the same state, checked)
        engine.scheduler.connector = CheckedOffload.__new__(CheckedOffload)
        engine.scheduler.connector.__dict__.update(vars(connector))
    results = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        tokens, cached = [], 0
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.samples[0].token_ids
                cached = delta.num_cached_tokens
            check_invariants(engine)
        results.append((tokens, cached))
    return results


def check_invariants(engine: LLMEngine) -> None:
    engine.kv_cache.check_invariants()
    if engine.scheduler.connector is not None:
        engine.scheduler.connector.check_invariants()


def metric(engine: LLMEngine, name: str) -> float:
    return next(m.value for m in engine.scheduler.connector.metrics() if m.name == name)


def check_leak_free(engine: LLMEngine) -> None:
    """Nothing is held once every request ended: the device pools are free, nothing loads."""
    assert not engine.scheduler.loading and not engine.scheduler.held
    if isinstance(engine.scheduler.connector, OffloadScheduler):
        assert not engine.scheduler.connector.in_flight
    for group in engine.kv_cache.groups:
        assert group.num_free_blocks == group.num_blocks - 1
    check_invariants(engine)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_evicted_prefixes_come_back_from_host_memory(models, family):
    path, want = models(family)
    engine = LLMEngine(EngineConfig(str(path), kv_offload_bytes=4 << 20, **SMALL))
    got = run_one_by_one(engine)
    assert [tokens for tokens, _ in got] == want
    # The second visit of each prefix finds all of its five blocks, loaded from the host.
    assert [cached for _, cached in got] == [0, 0, 0, 40, 40, 40]
    assert metric(engine, "kv_offload_loaded_blocks") == 15
    assert metric(engine, "kv_offload_stored_blocks") >= 15
    if family == "qwen3_5":  # each prompt's state where its 40 tokens end, from the host
        assert metric(engine, "kv_offload_loaded_checkpoints") == 3
        assert metric(engine, "kv_offload_stored_checkpoints") >= 3
    check_leak_free(engine)
    # /metrics, from the snapshot the engine core sends (msgpack) as a front reads it
    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineStats.of(engine)), type=EngineStats)
    text = ServerMetrics(lambda: stats).render().decode()
    assert "heron:kv_offload_loaded_blocks_total 15.0" in text
    assert "heron:kv_offload_host_usage_perc " in text


def test_without_the_tier_the_prefixes_are_recomputed(models):
    path, want = models("llama")
    engine = LLMEngine(EngineConfig(str(path), **SMALL))
    got = run_one_by_one(engine)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == [0] * 6


def test_the_host_pool_keeps_the_most_recent_blocks(models):
    """A host pool of seven blocks keeps the newest prefix whole: it is served from the host,
    the oldest is recomputed, and the pool holds no more than its blocks."""
    path, want = models("llama")
    per_block = 2 * BLOCK * 2 * 16 * 4 * 3  # K and V, 2 heads of 16, fp32, 3 layers
    engine = LLMEngine(EngineConfig(str(path), kv_offload_bytes=7 * per_block, **SMALL))
    order = [0, 1, 2, 5, 3]
    got = run_one_by_one(engine, [PROMPTS[i] for i in order])
    assert [tokens for tokens, _ in got] == [want[i] for i in order]
    assert [cached for _, cached in got][3:] == [40, 0]
    assert metric(engine, "kv_offload_host_total_blocks") == 7
    assert engine.scheduler.connector.index.num_evicted > 0


class HeldLoads(OffloadWorker):
    """Reports its ended loads only once released (a connector whose loads outlast a step)."""

    def __init__(self, num_slots: int, num_state_slots: int) -> None:
        super().__init__(num_slots, num_state_slots)
        self.held: list[str] = []
        self.released = False

    def take_results(self):
        results = super().take_results()
        self.held += results.loaded
        results.loaded = []
        if self.released:
            results.loaded, self.held = self.held, []
        return results


class FailingLoads(OffloadWorker):
    def start_step(self, meta):
        if meta.load_slots:
            raise KVTransferError("the host pool went away")
        super().start_step(meta)


class FailingSaves(OffloadWorker):
    def end_step(self, meta):
        if meta.save_slots:
            raise KVTransferError("the host pool went away")


def _with_worker(path, worker_class, **options) -> LLMEngine:
    """An engine whose offload connector's worker side is a ``worker_class``, the connector
    given ``options`` beside its bytes."""
    offload = {
        "kv_connector": "offload",
        "kv_connector_extra_config": {"num_bytes": 4 << 20, **options},
    }
    engine = LLMEngine(EngineConfig(str(path), kv_transfer_config=offload, **SMALL))
    default = engine.runner.kv_connector
    worker = worker_class(default.num_slots, default.num_state_slots)
    engine.runner.set_kv_connector(worker)
    return engine


@pytest.mark.parametrize(
    "worker, options, logged",
    [
        (FailingLoads, {}, "the host pool went away"),
        (HeldLoads, {"load_timeout_s": 0.2}, "timed out"),
    ],
)
def test_failed_or_hung_loads_are_recomputed(models, caplog, worker, options, logged):
    """A load that raises, or never ends (past the connector's timeout): its tokens are
    computed instead, the same ones, and nothing stays held."""
    path, want = models("llama")
    engine = _with_worker(path, worker, **options)
    got = run_one_by_one(engine)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == [0] * 6
    assert metric(engine, "kv_offload_failed_loads") == 3
    assert metric(engine, "kv_offload_loaded_blocks") == 0
    assert logged in caplog.text
    check_leak_free(engine)
    if worker is HeldLoads:
        engine.runner.kv_connector.released = True  # the loads' late ends reach no one
        assert run_one_by_one(engine, PROMPTS[:1])[0][0] == want[0]
        assert metric(engine, "kv_offload_failed_loads") == 3
        check_leak_free(engine)


def test_failed_saves_leave_nothing_to_load(models):
    path, want = models("llama")
    engine = _with_worker(path, FailingSaves)
    got = run_one_by_one(engine)
    assert [tokens for tokens, _ in got] == want
    assert metric(engine, "kv_offload_host_usage_perc") == 0
    assert metric(engine, "kv_offload_loaded_blocks") == 0
    check_leak_free(engine)


@pytest.mark.parametrize("end", ["abort", "shutdown"])
def test_an_abort_or_a_shutdown_during_a_load_frees_its_blocks(models, end):
    path, want = models("llama")
    engine = _with_worker(path, HeldLoads)
    run_one_by_one(engine, PROMPTS[:3])
    engine.add_request("a", PROMPTS[3], GREEDY)
    engine.step()
    engine.step()
    assert "a" in engine.scheduler.loading  # (other requests would run meanwhile)
    if end == "shutdown":
        engine.shutdown()
        assert engine.scheduler.connector is None
        check_leak_free(engine)
        return
    engine.abort_request("a")
    check_leak_free(engine)
    engine.runner.kv_connector.released = True  # the aborted load's end reaches no one
    assert run_one_by_one(engine, PROMPTS[4:5])[0][0] == want[4]
    check_leak_free(engine)


class DeferredSaves(OffloadWorker):
    """Leaves each step's saves staged, as on CUDA, to be placed when the pools are next
    used (or at shutdown)."""

    def _save(self, slots, blocks, states):
        self._pending = (
            SimpleNamespace(synchronize=lambda: None),
            self._stage(slots, blocks, states),
        )


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_saves_staged_as_on_cuda_serve_later_loads_and_are_placed_at_shutdown(models, family):
    path, want = models(family)
    engine = _with_worker(path, DeferredSaves)
    got = run_one_by_one(engine)
    assert [tokens for tokens, _ in got] == want
    assert [cached for _, cached in got] == [0, 0, 0, 40, 40, 40]
    worker = engine.runner.kv_connector
    assert worker._pending is not None  # the last step's saves
    engine.shutdown()
    assert worker._pending is None


@pytest.mark.parametrize(
    "side, method",
    [("scheduler", m) for m in ("lookup", "load", "scheduled", "finished")]
    + [("worker", "take_results")],
)
def test_a_connector_that_raises_is_switched_off_and_the_engine_runs_on(
    models, side, method, monkeypatch, caplog
):
    """Once the prefixes are on the host, a connector method raises (where the first
    prefix comes back: its lookup, its load, the step's transfers, the results): the
    engine logs it, computes without the connector, and the outputs stay HF's."""
    path, want = models("llama")
    engine = LLMEngine(EngineConfig(str(path), kv_offload_bytes=4 << 20, **SMALL))
    got = run_one_by_one(engine, PROMPTS[:3])
    connector = engine.scheduler.connector if side == "scheduler" else engine.runner.kv_connector

    def broken(*args):
        raise RuntimeError("the connector broke")

    monkeypatch.setattr(connector, method, broken)
    got += run_one_by_one(engine, PROMPTS[3:])
    assert [tokens for tokens, _ in got] == want
    assert engine.scheduler.connector is None
    assert "the connector broke" in caplog.text
    check_leak_free(engine)


def test_a_second_request_on_a_prefix_being_loaded_waits_for_it(models):
    path, want = models("llama")
    engine = LLMEngine(EngineConfig(str(path), kv_offload_bytes=4 << 20, **SMALL))
    run_one_by_one(engine, PROMPTS[:3])
    twin = PREFIXES[0] + [100, 101]
    engine.add_request("x", PROMPTS[3], GREEDY)
    engine.add_request("y", twin, GREEDY)
    tokens = {"x": [], "y": []}
    cached = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.samples[0].token_ids
            cached[delta.request_id] = delta.num_cached_tokens
        check_invariants(engine)
    assert tokens["x"] == want[3]
    assert cached == {"x": 40, "y": 40}  # y hit x's loaded blocks on the device
    assert metric(engine, "kv_offload_loaded_blocks") == 5


class FailingFreedSaves(OffloadWorker):
    """Its saves of freed blocks (made as a step starts) raise."""

    starting = False

    def start_step(self, meta):
        self.starting = True
        try:
            super().start_step(meta)
        finally:
            self.starting = False

    def _save(self, slots, blocks, states):
        if self.starting:
            raise KVTransferError("the host pool went away")
        super()._save(slots, blocks, states)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("worker, num_loaded", [(OffloadWorker, 6), (FailingFreedSaves, 5)])
def test_a_finished_conversation_turn_is_offloaded_whole(models, family, worker, num_loaded):
    """The block a turn's last step fills is registered only as the request is freed (its
    last input token was still being sampled when the step was scheduled): it is saved then
    (and Qwen3.5's state checkpoint there), so the next turn, once other prompts pushed the
    conversation off the device, loads every full block of the previous prompt and answer.
    If that save fails, its block is forgotten and recomputed: the same tokens."""
    path, _ = models(family)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    turn = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    engine = _with_worker(path, worker)
    engine.add_request("turn1", PREFIXES[0], turn)
    answer = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            answer += delta.samples[0].token_ids
    assert answer == hf_greedy(hf, [PREFIXES[0]], 9)[0]
    run_one_by_one(engine, PROMPTS[1:3])  # (evicts the conversation from the device)
    follow_up = PREFIXES[0] + answer + [5, 9]
    ((tokens, cached),) = run_one_by_one(engine, [follow_up])
    assert tokens == hf_greedy(hf, [follow_up], MAX_NEW)[0]
    # 40 prompt tokens and 8 computed answer tokens: 6 blocks (5 without the last)
    assert cached == num_loaded * BLOCK
    assert metric(engine, "kv_offload_loaded_blocks") == num_loaded
    if family == "qwen3_5":  # the state after the answer's last full block, or the prompt's
        assert metric(engine, "kv_offload_loaded_checkpoints") == 1
    check_leak_free(engine)


class LayerwiseSaver(OffloadWorker):
    """Saves each layer from its own thread, once the layer step counter says the layer was
    written, and records any saved block still holding the poison every cache starts with."""

    layerwise = True

    def register_caches(self, layout, layer_steps):
        super().register_caches(layout, layer_steps)
        for cache in layout.caches:
            cache.fill_(POISON)
        self.steps, self.poisoned, self.timed_out = layer_steps, [], False

    def start_step(self, meta):
        super().start_step(meta)
        self._thread = None
        if meta.save_slots:  # (saves come with rows: the step runs a forward pass)
            base = self.steps.count
            self._thread = threading.Thread(target=self._save_layers, args=(meta, base))
            self._thread.start()

    def _save_layers(self, meta, base):
        blocks, slots = torch.tensor(meta.save_blocks).T, torch.tensor(meta.save_slots)
        for layer, (cache, host, axis, group) in enumerate(self._layers):
            if not self.steps.wait_for(base + layer + 1, timeout_s=5):
                self.timed_out = True
                return
            saved = cache.index_select(axis, blocks[group].to(cache.device)).cpu()
            self.poisoned.append(bool((saved == POISON).any()))
            host.index_copy_(axis, slots, saved)

    def end_step(self, meta):
        if self._thread is not None:
            self._thread.join()


@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "graph-replays"])
def test_a_layerwise_saver_never_sees_a_layer_before_it_was_written(models, replayed):
    """Eagerly, and with decode steps replayed from emulated graphs (captured views over
    graph buffers, as on CUDA)."""
    path, want = models("llama")
    engine = LLMEngine(EngineConfig(str(path), kv_offload_bytes=4 << 20, **SMALL))
    runner = engine.runner
    saver = LayerwiseSaver(runner.kv_connector.num_slots)
    runner.set_kv_connector(saver)
    owners, steps = runner.cache.owners, runner.layer_steps
    records = []  # (cache owner, the count after its forward), hooked after the runner's
    for i, owner in enumerate(owners):
        owner.register_forward_hook(lambda *_, i=i: records.append((i, steps.count)))
    if replayed:  # (its warm-up forwards record too)
        runner.graphs = ViewReplay(runner.model, runner.plan, runner.device, 4, {})
        runner.graphs.replayed = []
        runner.graphs.capture(runner.block_size, runner.inputs.parts)
    got = run_one_by_one(engine)
    assert [tokens for tokens, _ in got] == want  # loaded back from what it saved
    assert [cached for _, cached in got][3:] == [40, 40, 40]
    assert saver.poisoned and not any(saver.poisoned) and not saver.timed_out
    # One record per owner's forward, in layer order, step after step.
    assert [count for _, count in records] == list(range(1, len(records) + 1))
    assert [i for i, _ in records] == list(range(len(owners))) * (len(records) // len(owners))
    assert not replayed or len(runner.graphs.replayed) >= len(PROMPTS) * (MAX_NEW - 2)


@pytest.mark.gpu
def test_captured_decode_graphs_record_every_layer_step(models):
    """The records are stream operations: graphs captured with a layerwise connector repeat
    them at every replay (a forward hook cannot fire there), so the count after a run is one
    per cache owner for every forward, eager or replayed, and the graphs stay whole."""
    path, want = models("llama")
    options = dict(kv_offload_bytes=4 << 20, device="cuda", dtype="float32", **SMALL)
    engine = LLMEngine(EngineConfig(str(path), **options))
    saver = LayerwiseSaver(engine.runner.kv_connector.num_slots)
    runner = engine.runner
    runner.set_kv_connector(saver)
    runner.rebuild_graphs()  # captured with the records in them
    torch.cuda.synchronize()
    start, layers = runner.layer_steps.count, len(runner.cache.owners)
    forwards = []
    runner.model.register_forward_hook(lambda *_: forwards.append("eager"))
    replay = runner.graphs.run
    runner.graphs.run = lambda seq: forwards.append("replay") or replay(seq)
    got = run_one_by_one(engine)
    torch.cuda.synchronize()
    assert [tokens for tokens, _ in got] == want
    assert forwards.count("replay") >= len(PROMPTS) * (MAX_NEW - 2)
    assert runner.layer_steps.count - start == len(forwards) * layers
    assert saver.poisoned and not any(saver.poisoned) and not saver.timed_out
