"""speculative_config: accepted as vLLM spells it, every bad field refused by name (Python and
CLI)."""

import pytest

from heron import LLM
from heron.cli import build_parser, engine_config, main
from heron.config import EngineConfig, SpeculativeConfig

from tiny_models import make_tokenizer, save_random_model, save_tiny_model, tiny_config

DRAFT = {"method": "draft_model", "model": "d", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def test_vllm_spelling_is_accepted():
    config = EngineConfig(
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    )
    assert config.speculative == SpeculativeConfig("ngram", 4, 2, 5)
    assert EngineConfig().speculative is None
    assert EngineConfig(speculative_config=MTP).speculative == SpeculativeConfig("mtp", 2)
    for options in (DRAFT, DRAFT | {"draft_tensor_parallel_size": 1}):
        assert EngineConfig(speculative_config=options).speculative == SpeculativeConfig(
            "draft_model", 3, model="d"
        )
    assert EngineConfig(speculative_config=DRAFT).speculative.async_verification  # the default


@pytest.mark.parametrize(
    "options, named",
    [
        ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "'lookahead'"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method must be one of ngram"),
        ({"num_speculative_tokens": 4}, "'method' is required"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"},
            "prompt_lookup_max must be",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4},
            "prompt_lookup_min (4) must not exceed prompt_lookup_max (3)",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
            "disable_by_batch_size must be",
        ),
        ("ngram", "must be a dictionary"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'model' (the draft model"),
        ({"method": "draft_model", "model": "", "num_speculative_tokens": 3}, "'model' (the"),
        (
            {"method": "ngram", "model": "d", "num_speculative_tokens": 3},
            "model applies to method 'draft_model', not 'ngram'",
        ),
        (DRAFT | {"prompt_lookup_max": 2}, "prompt_lookup_max applies to method 'ngram'"),
        (DRAFT | {"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
        (DRAFT | {"draft_tensor_parallel_size": True}, "draft_tensor_parallel_size must be 1"),
        (MTP | {"prompt_lookup_max": 2}, "prompt_lookup_max applies to method 'ngram', not 'mtp'"),
        (MTP | {"model": "d"}, "model applies to method 'draft_model', not 'mtp'"),
        (DRAFT | {"async_verification": "yes"}, "async_verification must be true or false"),
        (MTP | {"async_verification": True}, "async_verification applies to method 'draft"),
    ],
)
def test_bad_configurations_name_the_field(options, named):
    with pytest.raises(ValueError, match="speculative_config") as e:
        EngineConfig(speculative_config=options)
    assert named in str(e.value)


def test_mtp_beside_tensor_parallelism_is_refused_naming_both_fields():
    """(A draft model beside a sharded target runs: tests/distributed.)"""
    with pytest.raises(ValueError, match=r"method 'mtp' needs tensor_parallel_size 1.* got "):
        EngineConfig(speculative_config=MTP, tensor_parallel_size=2)
    assert EngineConfig(speculative_config=DRAFT, tensor_parallel_size=2).speculative.model == "d"


def test_cli_flag_on_every_command():
    parser = build_parser()
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    for command in (["generate"], ["chat"], ["plan"], ["serve"]):
        args = parser.parse_args([*command, "--speculative-config", flag])
        assert engine_config(args).speculative == SpeculativeConfig("ngram", 3, 1, 4)
    draft = '{"method": "draft_model", "model": "d", "num_speculative_tokens": 3}'
    for command in (["generate"], ["chat"], ["plan"], ["serve"]):
        args = parser.parse_args([*command, "--speculative-config", draft])
        assert engine_config(args).speculative == SpeculativeConfig("draft_model", 3, model="d")


def test_cli_errors(capsys, tiny_model_dir):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--speculative-config", "{method: ngram}"])
    assert "not valid JSON" in capsys.readouterr().err
    model = str(tiny_model_dir("llama"))
    bad = '{"method": "ngram", "num_speculative_tokens": 3, "k": 1}'
    assert main(["plan", "--model", model, "--speculative-config", bad]) == 2
    assert "unknown field(s) 'k'" in capsys.readouterr().err


def test_a_draft_model_that_cannot_serve_is_named(tiny_model_dir, tmp_path):
    """A path that does not load, or a draft of another vocabulary, is an error naming the
    draft (and the target)."""
    target = str(tiny_model_dir("llama"))
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="speculative_config: model '/nonexistent' cannot be"):
        LLM(target, speculative_config=spec | {"model": "/nonexistent"})
    config = tiny_config("llama")
    config.vocab_size = 300
    other_size = save_random_model(config, tmp_path / "size")
    with pytest.raises(ValueError, match="vocabulary sizes differ") as e:
        LLM(target, speculative_config=spec | {"model": str(other_size)})
    assert str(other_size) in str(e.value) and target in str(e.value)
    other_tokens = save_tiny_model("llama", tmp_path / "tokens")
    make_tokenizer(300).save_pretrained(other_tokens)
    with pytest.raises(ValueError, match="tokenizers' vocabularies differ"):
        LLM(target, speculative_config=spec | {"model": str(other_tokens)})
