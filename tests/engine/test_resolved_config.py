"""Options are checked and every ``auto`` settled once, before anything is built."""

from __future__ import annotations

import pytest

from heron.config import EngineConfig
from heron.engine.resolved_config import resolve


@pytest.mark.parametrize("backend", ["flash", "Triton", ""])
def test_an_unknown_backend_is_refused_by_name_before_any_build(backend):
    with pytest.raises(ValueError, match=f"attention_backend {backend!r} has no attention"):
        EngineConfig(model="/nowhere", attention_backend=backend)


def test_a_backend_one_operator_kind_lacks_is_refused_naming_the_kind(monkeypatch):
    """A hybrid model's gated-delta-rule layers follow the same switch: a backend with paged
    attention but no such operator is refused up front, not with a KeyError mid-build."""
    from heron.ops import backends

    attention = {**backends.ATTENTION_BACKENDS, "paged-only": backends.ATTENTION_BACKENDS["triton"]}
    monkeypatch.setitem(backends.OPERATOR_BACKENDS, "attention", attention)
    with pytest.raises(ValueError, match="'paged-only' has no gated delta rule operator"):
        EngineConfig(model="/nowhere", attention_backend="paged-only")


def test_auto_options_resolve_from_the_platform(tiny_model_dir):
    options = EngineConfig(
        model=str(tiny_model_dir("llama")),
        device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    resolved = resolve(options)
    assert resolved.device.type == "cpu"
    assert (resolved.block_size, resolved.attention_backend) == (16, "reference")
    assert resolved.max_num_batched_tokens == 256  # a CPU step stays short
    assert resolved.long_prefill_token_threshold == 128  # half of it, while others wait
    assert not resolved.cuda_graphs
    assert resolved.speculative is options.speculative  # parsed once
    assert resolved.speculative.num_speculative_tokens == 2
    with pytest.raises(AttributeError):
        resolved.block_size = 32  # frozen


def test_given_options_win_over_the_platform(tiny_model_dir):
    options = EngineConfig(
        model=str(tiny_model_dir("llama")),
        device="cpu",
        block_size=32,
        attention_backend="triton",
        max_num_batched_tokens=64,
    )
    resolved = resolve(options)
    assert (resolved.block_size, resolved.attention_backend) == (32, "triton")
    assert resolved.max_num_batched_tokens == 64
    assert resolved.long_prefill_token_threshold == 32
