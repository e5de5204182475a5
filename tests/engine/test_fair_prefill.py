"""Fair prefill: a short prompt arriving while a long one prefills gets its first token in the
next step, beside the long prompt's chunk (cut to ``long_prefill_token_threshold``), instead of
after the long prompt's last chunk; counted in steps, on the engine of a tiny model with an
8k-token context."""

from __future__ import annotations

import pytest

from heron import SamplingParams
from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine

from tiny_models import save_random_model, tiny_config

CONTEXT = 8192
BUDGET = 256
LONG = list(range(20, 300)) * 29  # 8,120 tokens
SHORT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    config = tiny_config("qwen2")
    config.max_position_embeddings = CONTEXT
    return save_random_model(config, tmp_path_factory.mktemp("long-context"))


def _engine(model_dir, **options) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            max_num_batched_tokens=BUDGET,
            num_kv_blocks=2 * CONTEXT // 16,
            async_scheduling=False,  # each step's tokens are read in that step
            **options,
        )
    )


def _computed(engine: LLMEngine, request_id: str) -> int:
    (sample,) = engine.samples(request_id)
    return sample.num_computed_tokens


def _steps_to_first_token(engine: LLMEngine, request_id: str) -> int:
    steps = 0
    while not any(o.request_id == request_id for o in engine.step()):
        steps += 1
        assert steps < 100
    return steps + 1


def test_a_short_prompt_beside_a_long_prefill_is_answered_in_the_next_step(long_context_dir):
    engine = _engine(long_context_dir)
    threshold = engine.scheduler.config.long_prefill_token_threshold
    assert threshold == BUDGET // 2
    one = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request("long", LONG, one)
    engine.step()
    assert _computed(engine, "long") == BUDGET  # alone, it has the whole budget
    engine.add_request("short", SHORT, one)
    assert _steps_to_first_token(engine, "short") == 1
    # The long prompt computed its threshold beside it, and is still prefilling.
    assert _computed(engine, "long") == BUDGET + threshold < len(LONG)
    engine.step()
    assert _computed(engine, "long") == 2 * BUDGET + threshold  # alone again
    engine.abort_request("long")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1  # (the null block)


def test_without_the_threshold_the_short_prompt_waits_for_the_long_one(long_context_dir):
    """The reference: threshold 0 gives every step's budget to the long prompt."""
    engine = _engine(long_context_dir, long_prefill_token_threshold=0)
    one = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request("long", LONG, one)
    engine.step()
    engine.add_request("short", SHORT, one)
    assert _steps_to_first_token(engine, "short") == -(-(len(LONG) - BUDGET) // BUDGET)


def test_long_prefills_past_the_limit_let_short_ones_pass(long_context_dir):
    engine = _engine(long_context_dir, max_long_partial_prefills=1)
    one = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request("long", LONG, one)
    engine.add_request("second long", LONG[1:], one)
    engine.add_request("short", SHORT, one)
    assert _steps_to_first_token(engine, "short") == 1
    assert _computed(engine, "second long") == 0  # passed over: one long prefill at a time
    for request_id in ("long", "second long"):
        engine.abort_request(request_id)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills must be >= 1"),
        (
            {"max_num_partial_prefills": 2, "max_long_partial_prefills": 3},
            r"max_long_partial_prefills \(3\) must be <= max_num_partial_prefills \(2\)",
        ),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be >= 1"),
    ],
)
def test_prefill_and_budget_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
