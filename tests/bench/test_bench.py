"""``heron bench``: the decode benchmark on the CPU and its JSON result, workload A against
nano-vllm's published totals, the floors' weight bytes against HF's models, and the page
BENCHMARKS.md is made from the results."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

from heron.bench.measure import step_bytes
from heron.bench.shapes import SHAPES
from heron.bench.throughput import workload
from heron.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_decode_on_the_cpu_writes_its_result(tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = ["bench", "decode", "--shape", "qwen3-0.6b", "--batch", "1", "--device", "cpu"]
    argv += ["--num-layers", "1", "--dtype", "bfloat16", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "heron " + " ".join(argv)
    assert {"commit", "dirty", "date", "device", "versions", "config", "metrics"} <= set(result)
    assert result["device"].startswith("CPU")
    assert result["versions"]["torch"] == torch.__version__
    assert result["config"]["engine"]["device"] == "cpu"
    assert result["config"]["num_layers"] == 1
    step, rate = result["metrics"]
    assert step["name"] == "qwen3-0.6b (1 layer), context 16, batch 1: ms/step"
    assert step["unit"] == "ms"
    assert step["value"] > 0 and step["floor"] is None  # no bandwidth floor on the CPU
    assert rate["unit"] == "tok/s" and rate["value"] > 0
    assert "qwen3-0.6b (1 layer), context 16, batch 1: ms/step" in capsys.readouterr().out


def test_embedding_throughput_on_the_cpu(tmp_path):
    """The shape runs as a pooling model; a figure pair per input length and batch."""
    out = tmp_path / "embed.json"
    argv = ["bench", "embed", "--shape", "qwen3-0.6b", "--num-layers", "1", "--device", "cpu"]
    assert main([*argv, "--batch", "1", "2", "--input-len", "8", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["runner"] == "pooling"
    names = [(m["name"], m["unit"]) for m in result["metrics"] if m["value"] > 0]
    assert names == [
        (f"qwen3-0.6b (1 layer), 8-token inputs, batch {b}: {what}", unit)
        for b in (1, 2)
        for what, unit in (("inputs/s", "inputs/s"), ("tokens/s", "tok/s"))
    ]


def test_decode_of_packed_int4_weights(capsys):
    """A one-layer shape's dummy weights quantised to AWQ's W4A16 layout: every projection
    packed, and the figure says so."""
    argv = ["bench", "decode", "--shape", "qwen3-0.6b", "--num-layers", "1", "--batch", "2"]
    argv += ["--device", "cpu", "--dtype", "bfloat16", "--weight-format", "awq"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "qwen3-0.6b (1 layer, awq W4A16 weights), context 16, batch 2: ms/step" in out
    assert main(["bench", "decode", "--model", "x", "--weight-format", "gptq"]) == 2
    assert "--weight-format packs a --shape's random weights" in capsys.readouterr().err


def test_host_step_with_the_model_stubbed(tmp_path):
    out = tmp_path / "host.json"
    argv = ["bench", "host", "--batch", "2", "--context", "32", "--steps", "3"]
    assert main([*argv, "--commit", "0123abc", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "host" and result["config"]["batch"] == 2
    assert result["commit"] == "0123abc"  # as given: a copy of a tree may have no .git
    median, mean = result["metrics"]
    case = "gemma-3-1b, batch 2, context 32, blocks of 64"
    assert median["name"] == f"{case}: host µs per engine step (median)"
    assert mean["name"] == f"{case}: host µs per engine step (mean)"
    assert median["value"] > 0 and mean["value"] > 0


def test_workload_a_is_nano_vllms():
    """nano-vllm's README gives its bench.py workload's totals: 133,966 output tokens (of
    256 requests) and 142,827 prompt tokens."""
    prompts, params = workload()
    assert len(prompts) == 256
    assert sum(p.max_tokens for p in params) == 133_966
    assert sum(map(len, prompts)) == 142_827
    assert all(p.ignore_eos and p.temperature == 0.6 for p in params)
    assert all(0 <= t <= 10_000 for p in prompts for t in p)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_floor_weights_are_the_models_matrices(name):
    """With every expert read and no cache, a step's floor bytes are two per element of the
    HF model's weight matrices (norms aside), less an untied embedding table (a step reads
    only its rows)."""
    shape = SHAPES[name]
    config = getattr(tf, shape.config_class)(**shape.fields)
    with torch.device("meta"):
        model = getattr(tf, shape.architecture)(config)
    matrices = sum(
        p.numel() for k, p in model.named_parameters() if p.dim() >= 2 and "norm" not in k
    )
    if not shape.fields["tie_word_embeddings"]:
        matrices -= shape.fields["vocab_size"] * shape.fields["hidden_size"]
    experts = next((shape.fields[k] for k in ("num_experts", "n_routed_experts",
                    "num_local_experts") if k in shape.fields), 0)  # fmt: skip
    assert step_bytes(shape, 0, 0, experts_read=experts) == 2 * matrices


def test_benchmarks_page_is_generated_from_the_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    metric = {"name": "ms/step, context 128, batch 1", "value": 0.9, "unit": "ms", "floor": 0.3}
    (results / "a.json").write_text(json.dumps({
        "bench": "decode", "command": "heron bench decode --shape qwen3-0.6b", "commit": "0123456789abcdef",
        "dirty": False, "date": "2026-12-02T10:00:00+00:00", "device": "NVIDIA H200",
        "versions": {}, "config": {}, "metrics": [metric],
    }))  # fmt: skip
    page = tmp_path / "BENCHMARKS.md"
    script = ROOT / "scripts" / "benchmarks_md.py"
    subprocess.run([sys.executable, script, "--results", results, "--output", page], check=True)
    text = page.read_text()
    assert "## heron bench decode" in text
    row = "| ms/step, context 128, batch 1 | 0.900 ms | 3.00× | NVIDIA H200 | - | 2026-12-02 | 0123456 |"
    assert row in text and "`heron bench decode --shape qwen3-0.6b`" in text


def test_turns_count_what_each_turn_computes_with_and_without_decode_checkpoints(tmp_path):
    """Two conversations of two turns on a tiny Qwen3.5 (GDN and attention layers), 16-token
    blocks: the second turn (20 + 14 + 5 tokens) resumes at 32 of the 33 tokens the first
    computed, or at the prompt's 16 without decode checkpoints."""
    from models.test_qwen3_5 import save_qwen3_5

    model, out = save_qwen3_5(tmp_path / "qwen3_5"), tmp_path / "turns.json"
    argv = ["bench", "turns", "--model", str(model), "--device", "cpu", "--block-size", "16"]
    argv += ["--conversations", "2", "--turns", "2", "--first-len", "20", "--message-len", "5"]
    argv += ["--answer-len", "14", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "turns" and result["config"]["conversations"] == 2
    values = {m["name"]: m["value"] for m in result["metrics"]}
    for run, cached in (("decode checkpoints (interval 0)", 64), ("no decode checkpoints", 32)):
        assert values[f"qwen3_5, {run}, turn 1: prompt tokens cached"] == 0
        assert values[f"qwen3_5, {run}, turn 2: prompt tokens cached"] == cached
        assert values[f"qwen3_5, {run}, turn 2: prompt tokens computed"] == 2 * 39 - cached
        assert values[f"qwen3_5, {run}, turn 2: mean TTFT"] > 0


def test_lora_cases_run_their_adapters(tmp_path, capsys):
    """Two random adapters of a one-layer shape (written by the benchmark) in one batch; the
    case names a rank other than the default."""
    out = tmp_path / "lora.json"
    argv = ["bench", "lora", "--shape", "qwen3-0.6b", "--num-layers", "1", "--batch", "2"]
    argv += ["--adapters", "2", "--lora-rank", "8", "--new-tokens", "3", "--device", "cpu"]
    assert main([*argv, "--dtype", "bfloat16", "--output-json", str(out)]) == 0
    names = [m["name"] for m in json.loads(out.read_text())["metrics"]]
    case = "qwen3-0.6b (1 layer), 2 adapters of rank 8 in 2 slots, context 16, batch 2"
    assert names == [f"{case}: ms/step", f"{case}: output tok/s"]


def test_lora_floor_counts_the_adapters_written(tmp_path):
    """An adapter's floor bytes are two per element of the tensors the benchmark writes."""
    from safetensors import safe_open

    from heron.bench.lora import adapter_bytes, write_adapters

    shape = SHAPES["qwen3-0.6b"].with_fields(num_hidden_layers=2)
    (lora,) = write_adapters(shape, 1, 16, tmp_path)
    with safe_open(Path(lora.lora_path) / "adapter_model.safetensors", "pt") as f:
        elements = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    assert adapter_bytes(shape, 16) == 2 * elements


def test_rollout_times_sleep_wake_up_and_updates(monkeypatch, capsys):
    """On a shrunk shape (the CPU writes and reloads its checkpoint): every figure comes out."""
    from heron.bench import shapes

    tiny = SHAPES["qwen3-0.6b"].with_fields(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32,
    )  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "qwen3-0.6b", tiny)
    argv = ["bench", "rollout", "--shape", "qwen3-0.6b", "--num-layers", "1", "--repeats", "1"]
    assert main([*argv, "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for figure in ("sleep, level 1", "wake up kv_cache, level 2", "update_weights, 13 tensors"):
        assert f"qwen3-0.6b (1 layer): {figure}: " in out
    assert "reload_weights from disk" in out


def test_offload_computes_fewer_prompt_tokens_with_the_host_tier(tmp_path):
    """Four conversations over two system prompts on a tiny Llama, one at a time, a device
    pool of a quarter of the working set: with the host tier the revisited prefixes are
    loaded, not computed."""
    from tiny_models import save_tiny_model

    model, out = save_tiny_model("llama", tmp_path / "llama"), tmp_path / "offload.json"
    argv = ["bench", "offload", "--model", str(model), "--device", "cpu", "--block-size", "8"]
    argv += ["--conversations", "4", "--systems", "2", "--system-len", "32", "--first-len", "8"]
    argv += ["--message-len", "8", "--answer-len", "2", "--turns", "2", "--batch", "1"]
    argv += ["--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "offload" and result["config"]["conversations"] == 4
    values = {m["name"]: m["value"] for m in result["metrics"]}
    without, with_tier = (
        sum(
            values[f"llama, {tier} the host tier, turn {t}: prompt tokens computed"] for t in (1, 2)
        )
        for tier in ("without", "with")
    )
    assert with_tier < without
    assert values["llama, with the host tier: blocks loaded from host"] > 0
    assert values["llama, with the host tier, turn 2: p50 TTFT"] > 0


def test_image_case_compares_image_and_text_requests(tmp_path):
    """Two image+text requests on a tiny Qwen3.5 with its vision tower, then text-only
    prompts of the same lengths: every figure is there and positive."""
    from multimodal.mm_models import save_qwen3_5_vl

    model, out = save_qwen3_5_vl(tmp_path / "vl"), tmp_path / "image.json"
    argv = ["bench", "image", "--model", str(model), "--device", "cpu", "--requests", "2"]
    argv += ["--text-len", "8", "--image-size", "32", "--output-len", "3"]
    argv += ["--output-json", str(out)]
    assert main(argv) == 0
    values = {m["name"]: m["value"] for m in json.loads(out.read_text())["metrics"]}
    for name in ("encoder per 32px image", "image+text mean TTFT", "text-only mean TTFT"):
        assert values[f"vl: {name}"] > 0
    assert values["vl: image+text output throughput"] > 0


def test_serve_figures_name_their_workload():
    from heron.bench.serve import workload

    args = {"prompt_tokens": 3000, "request_rate": 8.0, "pd": True, "kv_transfer_mode": "whole"}
    assert workload(args, 64) == (
        "concurrency 64, 3000-token prompts, 8 req/s, 1 prefill + 1 decode whole"
    )
    args |= {"prompt_tokens": None, "request_rate": None, "kv_transfer_mode": None}
    assert workload(args, 4) == "concurrency 4, 1 prefill + 1 decode"
