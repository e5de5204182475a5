"""Tensor parallelism on the CPU (gloo): two ranks against HF transformers and one rank, the
shards against the whole weights, and the workers' ends (shutdown, death, torchrun's launch)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers as tf
from ports import free_port
from tp_models import tiny_config

from heron import LLM, SamplingParams
from heron.config import ModelConfig
from heron.distributed.executor import WorkerDiedError
from heron.distributed.rendezvous import host_store
from heron.layers.activation import SiluAndMul
from heron.layers.mlp import GatedMLP
from heron.layers.moe import SparseMoE, SwiGLUExperts
from heron.layers.routing import Routing, TopKRouter
from heron.models.build import build_model
from heron.parallel import TensorParallel, tensor_parallel_scope
from heron.platforms import CpuPlatform

from tiny_models import (
    SHARED_PREFIX_PROMPTS,
    hf_greedy,
    hf_on_saved_weights,
    hf_on_weights,
    save_random_model,
    save_truncated_draft,
    write_fp8_checkpoint,
)

PROMPTS = SHARED_PREFIX_PROMPTS
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# 16-token prefill chunks, prefix caching, and 7 usable blocks of 16 tokens for a batch that
# needs about 11 at once: chunked prefill, prefix hits and preemption in every run (fair
# prefill off, so that each prompt prefills whole and the batch outgrows the pool).
# Under pytest-xdist the file must stay on one worker, in order (``--dist loadfile``): a
# family's shared engine holds the process's distributed group until its last test stops it.
ENGINE = dict(
    max_model_len=96, max_num_batched_tokens=16, num_kv_blocks=8, long_prefill_token_threshold=0
)
# The families tensor parallelism serves, latent attention (DeepSeek), the gated delta rule (Qwen3.5,
# Qwen3-Next) and the MoE layouts.
FAMILIES = ["llama", "qwen3", "gemma3", "gpt_oss", "qwen3_moe"]
FAMILIES += ["deepseek_v2", "deepseek_v3", "qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save_random_model(tiny_config(family), tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_worker():
    """Workers inherit the environment: one thread each on a small CI machine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, saved):
    """``(path, HF's greedy tokens, a two-rank LLM)``, the engine shared by the family's tests."""
    path = saved(request.param)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    yield path, hf_greedy(hf, PROMPTS, MAX_NEW), llm
    llm.engine.shutdown()


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_two_ranks_equal_hf(family):
    """(One rank equals HF on these settings too: tests/models.)"""
    _, refs, llm = family
    assert tokens(llm) == refs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.prefix_cache_hits > 0  # the first two prompts share two blocks


def test_shutdown_exits_the_workers_cleanly(family):
    """(Last of the family's tests: it stops the shared engine.)"""
    _, _, llm = family
    workers = llm.engine.runner._workers
    llm.engine.shutdown()
    assert {rank: proc.returncode for rank, proc in workers.items()} == {1: 0}


def build(path: Path, tp: TensorParallel | None = None) -> torch.nn.Module:
    """A model (or one rank's shard of it) built and loaded in this process, no group needed."""
    cpu = torch.device("cpu")
    config = ModelConfig.from_path(path, "float32", cpu, ENGINE["max_model_len"])
    return build_model(config, CpuPlatform(cpu), "reference", 16, tp or TensorParallel()).model


def gather(name: str, a: torch.Tensor, b: torch.Tensor, config) -> torch.Tensor:
    """The whole parameter from ranks 0 and 1's, by the layout of each kind of layer."""
    if name.endswith(("o_proj.bias", "down_proj.bias", "down_proj_bias")):
        assert not b.any()  # added once, after the all-reduce
        return a
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return torch.cat([a, b])[: config.vocab_size]
    if name.endswith("sinks"):
        return torch.cat([a, b])
    if name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "A_log", "dt_bias")):
        return torch.cat([a, b])  # by heads
    if name.endswith(("in_proj.weight", "conv1d.weight")):  # [q | k | v (| z | b | a)]
        keys = config.linear_num_key_heads * config.linear_key_head_dim // 2
        values = config.linear_num_value_heads * config.linear_value_head_dim // 2
        heads = config.linear_num_value_heads // 2
        sizes = [keys, keys, values, values, heads, heads][: 3 if "conv1d" in name else 6]
        return torch.cat([torch.cat(p) for p in zip(a.split(sizes), b.split(sizes))])
    if "qkv_proj" in name:  # [q | k | v], and Qwen3.5's gates after them
        q = config.num_attention_heads * config.head_dim // 2
        gates = q if hasattr(config, "linear_num_key_heads") else 0
        kv = (a.shape[0] - q - gates) // 2
        (qa, ka, va, ga), (qb, kb, vb, gb) = (t.split([q, kv, kv, gates]) for t in (a, b))
        if config.num_key_value_heads == 1:  # one head, held by both ranks
            assert torch.equal(ka, kb) and torch.equal(va, vb)
            return torch.cat([qa, qb, ka, va, ga, gb])
        return torch.cat([qa, qb, ka, kb, va, vb, ga, gb])
    if name.endswith("experts.gate_up_proj") and config.model_type == "gpt_oss":
        return torch.cat([a, b], dim=2)  # gate and up alternate: a rank's run of pairs
    if name.endswith("experts.gate_up_proj_bias"):
        return torch.cat([a, b], dim=1)
    if name.endswith("gate_up_proj.weight") or name.endswith("experts.gate_up_proj"):
        dim = a.dim() - 2  # [gate | up] rows of a linear layer or of each expert
        (ga, ua), (gb, ub) = a.chunk(2, dim), b.chunk(2, dim)
        return torch.cat([ga, gb, ua, ub], dim)
    if name.endswith("experts.down_proj"):
        return torch.cat([a, b], dim=1 if config.model_type == "gpt_oss" else 2)
    if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
        return torch.cat([a, b], dim=1)
    assert torch.equal(a, b), f"{name} should be the same on every rank"
    return a


@pytest.mark.parametrize("family", FAMILIES)
def test_shards_gather_to_the_whole_weights(saved, family):
    path = saved(family)
    whole = dict(build(path).named_parameters())
    ranks = [dict(build(path, TensorParallel(r, 2)).named_parameters()) for r in (0, 1)]
    config = tiny_config(family)
    assert whole.keys() == ranks[0].keys() == ranks[1].keys()
    for name, param in whole.items():
        assert torch.equal(gather(name, ranks[0][name], ranks[1][name], config), param), name


@pytest.mark.parametrize("layout", ["per-tensor", "per-channel", "block-wise"])
def test_two_ranks_load_fp8_checkpoints_equal_hf(saved, layout, tmp_path):
    """Per-tensor scales replicated, per-channel scales cut by rows, 16 x 16 block scales by
    whole blocks (each rank's 32 query rows, the KV head both hold, half of o's and down's
    input columns)."""
    src = saved("llama")
    weights = write_fp8_checkpoint(src, tmp_path / "fp8", layout, block=(16, 16))
    llm = LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **ENGINE)
    try:
        assert tokens(llm) == hf_greedy(hf_on_weights(src, weights), PROMPTS, MAX_NEW)
    finally:
        llm.engine.shutdown()


def test_two_ranks_load_block_wise_fp8_experts_equal_hf(saved, tmp_path):
    """Qwen3-MoE's per-expert FP8 tensors in 16 x 16 tiles: each rank holds its 16 of every
    expert's 32 gate and up rows and down columns, and their whole tiles of scales."""
    src = saved("qwen3_moe")
    weights = write_fp8_checkpoint(src, tmp_path / "fp8", "block-wise", block=(16, 16))
    llm = LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **ENGINE)
    try:
        hf = hf_on_saved_weights(src, weights, tmp_path / "dequantised")
        assert tokens(llm) == hf_greedy(hf, PROMPTS, MAX_NEW)
    finally:
        llm.engine.shutdown()


def test_a_rank_boundary_inside_an_fp8_block_is_refused_naming_the_layer(saved, tmp_path):
    """32-row blocks over the one 16-row KV head each rank holds."""
    write_fp8_checkpoint(saved("llama"), tmp_path / "fp8", "block-wise", block=(32, 32))
    message = (
        r"'model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv': .* 16 output rows, which split"
    )
    with pytest.raises(ValueError, match=message):
        build(tmp_path / "fp8", TensorParallel(0, 2))


def test_a_rank_boundary_inside_an_expert_fp8_block_is_refused_naming_the_tensor(saved, tmp_path):
    """32-row blocks over the 16 of each expert's 32 intermediate features a rank holds (the
    attention stays in full precision, so the experts are the first to split)."""
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    write_fp8_checkpoint(saved("qwen3_moe"), tmp_path / "fp8", "block-wise", attention)
    message = r"experts\.0\.\w+_proj\.weight_scale_inv': .* 16 intermediate features, which split"
    with pytest.raises(ValueError, match=message):
        build(tmp_path / "fp8", TensorParallel(0, 2))


def test_a_dead_worker_stops_the_engine_naming_its_rank(saved):
    llm = LLM(str(saved("gpt_oss")), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.runner._workers[1]
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    # Killed while the engine steps: a collective of the step fails, and the engine says why.
    killer = threading.Timer(1.0, worker.kill)
    killer.start()
    with pytest.raises(WorkerDiedError, match="worker rank 1 exited with code -9"):
        for _ in range(50):
            llm.generate(PROMPTS, long, use_tqdm=False)
    killer.join()
    with pytest.raises(WorkerDiedError, match="rank 1"):  # and goes on saying so
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.engine.shutdown()


def test_a_dropped_llm_leaves_the_process_group_to_the_next(saved):
    """No shutdown: dropping the last reference stops the workers and leaves the process
    group (a weak finalizer, not an exit hook holding the engine), so another tensor-parallel
    LLM starts in this process; ``with`` shuts that one down."""
    path = str(saved("llama"))
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    workers = dict(llm.engine.runner._workers)
    first = tokens(llm)
    del llm
    assert {rank: proc.returncode for rank, proc in workers.items()} == {1: 0}
    assert not torch.distributed.is_initialized()
    with LLM(path, tensor_parallel_size=2, **ENGINE) as second:
        assert tokens(second) == first
        workers = dict(second.engine.runner._workers)
    assert {rank: proc.returncode for rank, proc in workers.items()} == {1: 0}
    assert not torch.distributed.is_initialized()


def test_rank_zero_store_holds_its_port_from_the_start():
    """No other process can take the port between rank 0 choosing it and its store binding it."""
    rv, store = host_store(2)
    assert rv.master_port == store.port
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((rv.master_addr, rv.master_port))


def test_ranks_rendezvous_through_torchrun_environment(saved):
    """Two processes started as torchrun starts one rank per host, meeting on 127.0.0.1."""
    path = saved("llama")
    prompt, flags = "The quick brown fox", ["--max-model-len", "96", "--max-tokens", "8"]
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    command = [sys.executable, "-m", "heron.distributed.launch", "generate"]
    command += ["--model", str(path), "-tp", "2", "--prompt", prompt, *flags]
    ranks = [
        subprocess.Popen(
            command,
            env=env | {"RANK": str(r), "LOCAL_RANK": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err for _, err in outputs]
    one_rank = LLM(str(path), max_model_len=96).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )
    assert outputs[0][0] == one_rank[0].outputs[0].text + "\n"
    assert outputs[1][0] == ""  # a worker prints nothing


def test_a_shared_expert_summed_apart_from_the_experts_is_refused():
    """Its all-reduce and the block's would add it twice."""
    with tensor_parallel_scope(TensorParallel(0, 2)):
        router, experts = TopKRouter(16, 4, Routing(top_k=2)), SwiGLUExperts(4, 16, 8)
        with pytest.raises(ValueError, match="build the shared expert with reduce_output=False"):
            SparseMoE(router, experts, GatedMLP(16, 8, SiluAndMul))
        SparseMoE(router, experts, GatedMLP(16, 8, SiluAndMul, reduce_output=False))


def test_heads_split_evenly_and_kv_heads_are_shared_below_one_per_rank():
    assert [TensorParallel(r, 4).part(8, "heads") for r in range(4)] == [
        (0, 2),
        (2, 2),
        (4, 2),
        (6, 2),
    ]
    assert [TensorParallel(r, 4).part(2, "KV heads", shared=True) for r in range(4)] == [
        (0, 1), (0, 1), (1, 1), (1, 1)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="does not divide heads"):
        TensorParallel(0, 4).part(2, "heads")
    with pytest.raises(ValueError, match="nor does KV heads divide it"):
        TensorParallel(0, 4).part(3, "KV heads", shared=True)


# The tiny Qwen3.5 accepts none of its proposals: each verification step rolls every rank's
# GDN states back to the row's last token.
@pytest.mark.parametrize("family, accepts", [("llama", True), ("qwen3_5", False)])
def test_two_ranks_with_speculation_equal_hf(saved, family, accepts):
    """Verification steps and their rollback (of the KV cache; of the GDN states, each rank
    its heads') run the same on both ranks."""
    path = saved(family)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(str(path), tensor_parallel_size=2, speculative_config=ngram, **ENGINE)
    try:
        assert tokens(llm) == hf_greedy(hf, PROMPTS, MAX_NEW)
        stats = llm.spec_decode_stats
        assert (stats.num_accepted_tokens > 0) == accepts
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # refused: rolled back
    finally:
        llm.engine.shutdown()


def test_a_draft_model_beside_two_ranks_equals_hf(saved, tmp_path):
    """A one-device draft model (``method: "draft_model"``) proposing for a two-rank target:
    the target's verification steps and rollback run on both ranks, the draft on rank 0 only,
    with its own prefix cache and the target's preemptions."""
    path = saved("llama")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = save_truncated_draft(path, tmp_path / "draft")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(path), tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        assert tokens(llm) == hf_greedy(hf, PROMPTS, MAX_NEW)
        engine, stats = llm.engine, llm.spec_decode_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some refused
        assert engine.scheduler.num_preemptions > 0
        assert engine.proposer.kv_cache.prefix_cache_hits > 0
    finally:
        llm.engine.shutdown()
