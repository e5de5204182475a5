"""speculative_config: accepted as vLLM spells it, every bad field refused by name (Python and
CLI)."""

import pytest

from heron.cli import build_parser, engine_config, main
from heron.config import EngineConfig
from heron.speculative import SpeculativeConfig


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
    ],
)
def test_bad_configurations_name_the_field(options, named):
    with pytest.raises(ValueError, match="speculative_config") as e:
        EngineConfig(speculative_config=options)
    assert named in str(e.value)


def test_cli_flag_on_every_command():
    parser = build_parser()
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    for command in (["generate"], ["chat"], ["plan"], ["serve"]):
        args = parser.parse_args([*command, "--speculative-config", flag])
        assert engine_config(args).speculative == SpeculativeConfig("ngram", 3, 1, 4)


def test_cli_errors(capsys, tiny_model_dir):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--speculative-config", "{method: ngram}"])
    assert "not valid JSON" in capsys.readouterr().err
    model = str(tiny_model_dir("llama"))
    bad = '{"method": "ngram", "num_speculative_tokens": 3, "k": 1}'
    assert main(["plan", "--model", model, "--speculative-config", bad]) == 2
    assert "unknown field(s) 'k'" in capsys.readouterr().err
