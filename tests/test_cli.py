"""The command line: plan (text and JSON), generate, and errors."""

import json

from heron.cli import main


def test_plan_json_lists_groups_and_layers(tiny_model_dir, capsys):
    assert main(["plan", "--model", str(tiny_model_dir("mistral")), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fallback_reason"] is None
    (group,) = plan["groups"]
    assert {"group", "builder", "key", "cache_group", "layers", "graph_support"} <= set(group)
    assert group["layers"] == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert 24 in group["key"]  # Mistral's window is part of the key
    assert group["graph_support"] == "DECODE_ONLY"
    (cache,) = plan["cache_groups"]
    assert group["cache_group"] == cache["group"] == 0
    assert cache["spec"]["kind"] == "SlidingWindowSpec"
    assert cache["spec"]["sliding_window"] == 24 and cache["num_blocks"] > 0
    assert cache["description"].startswith("sliding window 24, full attention")
    assert cache["layers"] == group["layers"]


def test_plan_text(tiny_model_dir, capsys):
    assert main(["plan", "--model", str(tiny_model_dir("qwen3"))]) == 0
    text = capsys.readouterr().out
    assert "metadata group 0: PagedAttentionBuilder(reference)" in text
    assert "reads cache group 0" in text and "\ncache group 0: full attention" in text
    assert "model.layers.2.self_attn.attn" in text and "fallback: none" in text


def test_generate_prints_the_completion(tiny_model_dir, capsys):
    from heron import LLM, SamplingParams

    path = str(tiny_model_dir("llama"))
    args = ["generate", "--model", path, "--prompt", "Paris is", "--max-tokens", "6"]
    assert main(args) == 0
    want = LLM(path).generate("Paris is", SamplingParams(temperature=0, max_tokens=6))[0]
    assert capsys.readouterr().out == want.outputs[0].text + "\n"


def test_bad_model_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nope")]) == 2
    assert "neither a Hugging Face model directory" in capsys.readouterr().err


def test_bad_option_is_a_clear_error(tiny_model_dir, capsys):
    assert main(["plan", "--model", str(tiny_model_dir("llama")), "--max-model-len", "99999"]) == 2
    assert "max_model_len must be in [1, 512]" in capsys.readouterr().err


def test_plan_shows_fp8_weights_and_cache(tiny_model_dir, capsys):
    model = str(tiny_model_dir("qwen3"))
    assert main(["plan", "--model", model, "--quantization", "fp8", "--kv-cache-dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "weights: fp8 e4m3 weights, channel scales, quantised at load" in text
    assert "\ncache group 0: full attention" in text and "float8_e4m3fn;" in text
    assert main(["plan", "--model", model, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "unquantised"
    assert main(["plan", "--model", model, "--kv-cache-dtype", "e5m2"]) == 2
    assert "kv_cache_dtype must be one of auto, fp8, got 'e5m2'" in capsys.readouterr().err
