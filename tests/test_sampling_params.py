"""SamplingParams rejects every invalid value with the field's name and its allowed range."""

import pytest

from heron import SamplingParams
from heron.sampling_params import MAX_N
from heron.structured import StructuredOutputsParams

INVALID = [
    ("n", 0, "[1, 128]"),
    ("n", MAX_N + 1, "[1, 128]"),
    ("n", 1.5, "[1, 128]"),
    ("temperature", -0.1, "[0, 100]"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_k", -2, "[0, 2^63)"),
    ("top_k", 2**64, "[0, 2^63)"),
    ("min_p", 1.1, "[0, 1]"),
    ("repetition_penalty", 0.0, "(0, 10]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"),
    ("seed", "7", "integer"),
    ("seed", 2**64, "64-bit signed integer"),
    ("logit_bias", {5: 100.5}, "[-100, 100]"),
    ("logit_bias", {-1: 1.0}, "token ids in [0, 2^63)"),
    ("logit_bias", {2**64: 1.0}, "token ids in [0, 2^63)"),
    ("max_tokens", 0, "[1, 2^63)"),
    ("min_tokens", -1, "[0, 2^63)"),
    ("min_tokens", 2**64, "[0, 2^63)"),
    ("stop", [""], "non-empty"),
    ("stop_token_ids", [-1], "token ids"),
    ("stop_token_ids", [2**64], "[0, 2^63)"),
    ("logprobs", 21, "[0, 20]"),
    ("prompt_logprobs", -1, "[0, 20]"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), INVALID, ids=lambda v: str(v))
def test_invalid_value_names_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert message.startswith(field) and allowed in message and repr(value) in message


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_normalisation():
    p = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert p.stop == ["END"] and p.top_k == 0 and p.greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_plain_argmax_is_greedy_on_untouched_logits():
    assert SamplingParams(temperature=0).plain_argmax
    assert not SamplingParams(temperature=0, logit_bias={3: 1.0}).plain_argmax
    grammar = StructuredOutputsParams(regex="a+")
    assert not SamplingParams(temperature=0, structured_outputs=grammar).plain_argmax
