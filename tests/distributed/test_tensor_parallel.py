"""Tensor parallelism on the CPU (gloo): two ranks against HF transformers and one rank, the
shards against the whole weights, and the workers' ends (shutdown, death, torchrun's launch)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams
from heron.config import ModelConfig
from heron.distributed.executor import WorkerDiedError
from heron.distributed.parallel import TensorParallel
from heron.distributed.rendezvous import Rendezvous
from heron.models.build import build_model
from heron.platforms import CpuPlatform

from tiny_models import BASE, SHARED_PREFIX_PROMPTS, hf_greedy, make_tokenizer

PROMPTS = SHARED_PREFIX_PROMPTS
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# 16-token prefill chunks, prefix caching, and 7 usable blocks of 16 tokens for a batch that
# needs about 11 at once: chunked prefill, prefix hits and preemption in every run.
ENGINE = dict(max_model_len=96, max_num_batched_tokens=16, num_kv_blocks=8)
SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_config(family: str) -> tf.PretrainedConfig:
    """Tiny models whose shapes test the sharding: split and shared KV heads, a vocabulary that
    two ranks do not divide evenly, both expert layouts."""
    if family == "llama":  # one KV head: both ranks hold it
        return tf.LlamaConfig(**(BASE | dict(num_key_value_heads=1)), tie_word_embeddings=False)
    if family == "qwen3":  # qk-norm, head_dim apart from hidden / heads, tied, 321 tokens
        return tf.Qwen3Config(
            **(BASE | dict(vocab_size=321)), head_dim=32, tie_word_embeddings=True
        )
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **(BASE | dict(num_hidden_layers=4)),
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=12,
            layer_types=[SLIDING, FULL] * 2,
            final_logit_softcapping=15.0,
        )
    if family == "gpt_oss":  # sinks, biases everywhere, interleaved input-major experts
        return tf.GptOssConfig(
            **(BASE | dict(intermediate_size=32, num_hidden_layers=2)),
            layer_types=[SLIDING, FULL],
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            tie_word_embeddings=False,
        )
    if family == "qwen3_moe":  # one tensor per expert in the checkpoint; a dense layer
        return tf.Qwen3MoeConfig(
            **BASE,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
    raise ValueError(family)


# Generation runs the families the issue names; the weights test adds Qwen3-MoE's layout.
FAMILIES = ["llama", "qwen3", "gemma3", "gpt_oss"]


def save(family: str, path: Path) -> Path:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    with torch.no_grad():  # HF's init is small: scale up so logits and routing are decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.1)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save(family, tmp_path_factory.mktemp(family))
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


def test_two_ranks_equal_one_rank_and_hf(family):
    path, refs, llm = family
    assert tokens(llm) == refs
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.prefix_cache_hits > 0
    assert tokens(llm) == refs  # again, from the prefix cache
    assert tokens(LLM(str(path), **ENGINE)) == refs


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
    target = types.SimpleNamespace(plan=None)
    return build_model(config, CpuPlatform(cpu), target, "reference", 16, tp or TensorParallel())


def gather(name: str, a: torch.Tensor, b: torch.Tensor, config) -> torch.Tensor:
    """The whole parameter from ranks 0 and 1's, by the layout of each kind of layer."""
    if name.endswith(("o_proj.bias", "down_proj.bias", "down_proj_bias")):
        assert not b.any()  # added once, after the all-reduce
        return a
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return torch.cat([a, b])[: config.vocab_size]
    if name.endswith("sinks"):
        return torch.cat([a, b])
    if "qkv_proj" in name:
        q = config.num_attention_heads * config.head_dim // 2
        kv = (a.shape[0] - q) // 2
        (qa, ka, va), (qb, kb, vb) = a.split([q, kv, kv]), b.split([q, kv, kv])
        if config.num_key_value_heads == 1:  # one head, held by both ranks
            assert torch.equal(ka, kb) and torch.equal(va, vb)
            return torch.cat([qa, qb, ka, va])
        return torch.cat([qa, qb, ka, kb, va, vb])
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
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.cat([a, b], dim=1)
    assert torch.equal(a, b), f"{name} should be the same on every rank"
    return a


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss", "qwen3_moe"])
def test_shards_gather_to_the_whole_weights(saved, family):
    path = saved(family)
    whole = dict(build(path).named_parameters())
    ranks = [dict(build(path, TensorParallel(r, 2)).named_parameters()) for r in (0, 1)]
    config = tiny_config(family)
    assert whole.keys() == ranks[0].keys() == ranks[1].keys()
    for name, param in whole.items():
        assert torch.equal(gather(name, ranks[0][name], ranks[1][name], config), param), name


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


def test_ranks_rendezvous_through_torchrun_environment(saved):
    """Two processes started as torchrun starts one rank per host, meeting on 127.0.0.1."""
    path = saved("llama")
    prompt, flags = "The quick brown fox", ["--max-model-len", "96", "--max-tokens", "8"]
    rv = Rendezvous.on_this_host(2)
    env = os.environ | {
        "MASTER_ADDR": rv.master_addr,
        "MASTER_PORT": str(rv.master_port),
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
