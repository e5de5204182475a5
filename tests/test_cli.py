"""The command line: plan (text and JSON), generate, and errors."""

import json
import shutil
import socket

import pytest

from heron import __version__
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


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"heron {__version__}\n"


def test_serve_model_given_twice_is_an_error(capsys):
    assert main(["serve", "one", "--model", "other"]) == 2
    assert "given twice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "99999"], "must be a TCP port in [0, 65535], not 99999"),
        (["--max-request-body-bytes", "-5"], "must be at least 1, not -5"),
        (["--timeout-keep-alive", "0"], "must be at least 1, not 0"),
    ],
)
def test_serve_refuses_bad_numbers_before_anything_starts(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--allowed-origins", "http://a.example"], "--allowed-origins must be a JSON list"),
        (["--allowed-origins", '[""]'], "--allowed-origins must be a JSON list of origins"),
        (["--chat-template", "/no/such/template.jinja"], "neither a readable file"),
    ],
)
def test_serve_refuses_bad_values_before_the_model_loads(tmp_path, capsys, flags, message):
    assert main(["serve", str(tmp_path / "nope"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_binds_its_port_before_the_model_loads(tmp_path, capsys):
    """A port in use fails at once, not after the model loaded (this model does not exist)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", str(tmp_path / "nope"), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def _copy_without(src, dst, drop):
    shutil.copytree(src, dst, ignore=lambda _, names: [n for n in names if drop(n)])
    return dst


def test_loader_errors_name_the_file_or_value(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("qwen2")
    corrupt = _copy_without(model, tmp_path / "corrupt", lambda n: False)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    untokenized = _copy_without(model, tmp_path / "untokenized", lambda n: "token" in n)
    cases = [
        (["--model", str(model), "--device", "tpu"], "unknown device 'tpu'"),
        (["--model", str(corrupt)], f"{corrupt / 'model.safetensors'} is not a readable"),
        (["--model", str(untokenized)], f"{untokenized} has no tokenizer files"),
    ]
    capsys.readouterr()  # the fixture's own output
    for args, message in cases:
        assert main(["plan", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("heron: error: ") and message in err, err


def test_generate_says_when_the_model_ended_at_once(tiny_model_dir, tmp_path, capsys):
    """A model whose first greedy token is its end-of-sequence token (here made so)."""
    from heron import LLM, SamplingParams

    model = tiny_model_dir("llama")
    first = LLM(str(model)).generate("Paris is", SamplingParams(temperature=0, max_tokens=1))
    eos_at_once = _copy_without(model, tmp_path / "eos", lambda n: n == "generation_config.json")
    config = json.loads((eos_at_once / "config.json").read_text())
    config["eos_token_id"] = first[0].outputs[0].token_ids[0]
    (eos_at_once / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(eos_at_once), "--prompt", "Paris is"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n"
    assert "ended the completion at once" in captured.err and "heron chat" in captured.err


def test_plan_shows_fp8_weights_and_cache(tiny_model_dir, capsys):
    model = str(tiny_model_dir("qwen3"))
    assert main(["plan", "--model", model, "--quantization", "fp8", "--kv-cache-dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "weights: fp8 e4m3 weights, channel scales, quantised at load" in text
    assert "\ncache group 0: full attention" in text and "float8_e4m3fn;" in text
    assert main(["plan", "--model", model, "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    assert (
        weights.startswith("unquantised weights; ") and "MiB of weights a decoder layer" in weights
    )
    assert main(["plan", "--model", model, "--kv-cache-dtype", "e5m2"]) == 2
    assert "kv_cache_dtype must be one of auto, fp8, got 'e5m2'" in capsys.readouterr().err
