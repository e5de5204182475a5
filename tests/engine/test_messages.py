"""What the front and the engine core send each other survives msgpack unchanged."""

from __future__ import annotations

from dataclasses import fields

import msgspec
import pytest

from heron.engine.deltas import RequestDelta, SampleDelta
from heron.engine.messages import (
    AddRequest,
    CoreMessage,
    FrontMessage,
    StepOutputs,
)
from heron.outputs import Logprob
from heron.sampling_params import SamplingParams
from heron.structured import ReasoningTokens, StructuredOutputsParams

# A value other than the default for every field.
NON_DEFAULT = {
    "n": 3,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 1234,
    "max_tokens": None,
    "min_tokens": 2,
    "stop": ["</s>", "\n\n"],
    "stop_token_ids": [7, 9],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "logprobs": 5,
    "prompt_logprobs": 0,
    "skip_special_tokens": False,
    "logit_bias": {5: -100.0, 151643: 2.5},
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [0, 3]]},
    "eos_token_ids": frozenset({2, 151645}),
}
# Refused together with min_tokens and ignore_eos, so round-tripped on its own, every kind.
STRUCTURED_OUTPUTS = [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "array"}'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"[0-9]+"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),
    StructuredOutputsParams(regex="a+", reasoning=ReasoningTokens(end=7, start=6)),
]


PARAMS = 3  # AddRequest on the wire: [tag, request_id, prompt_token_ids, params, front]


def _round_trip(params: SamplingParams) -> SamplingParams:
    message = AddRequest("req-1", [1, 2, 3], params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=FrontMessage)
    assert decoded == message
    return decoded.params


def test_every_sampling_param_round_trips():
    names = {f.name for f in fields(SamplingParams)}
    assert set(NON_DEFAULT) | {"structured_outputs"} == names, "a new field: add it"
    params = SamplingParams(**NON_DEFAULT)
    default = SamplingParams()
    assert all(getattr(params, k) != getattr(default, k) for k in NON_DEFAULT)
    decoded = _round_trip(params)
    assert isinstance(decoded.eos_token_ids, frozenset)
    assert all(isinstance(t, int) for t in decoded.logit_bias)


@pytest.mark.parametrize("spec", STRUCTURED_OUTPUTS, ids=lambda s: s.kind)
def test_structured_outputs_round_trip(spec):
    decoded = _round_trip(SamplingParams(structured_outputs=spec, logit_bias={3: 1.0}))
    assert isinstance(decoded.structured_outputs, StructuredOutputsParams)
    assert decoded.structured_outputs.key == spec.key


def test_decoding_validates_structured_outputs():
    encoded = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams()))
    wire = msgspec.msgpack.decode(encoded)
    wire[PARAMS]["structured_outputs"] = {"regex": "a", "choice": ["b"]}
    with pytest.raises(msgspec.ValidationError, match="exactly one of"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=FrontMessage)


def test_decoding_validates_sampling_params():
    encoded = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams()))
    wire = msgspec.msgpack.decode(encoded)  # as plain data: [tag, id, ids, params]
    wire[PARAMS]["n"] = 0
    with pytest.raises(msgspec.ValidationError, match=r"n must be an integer in \[1, 128\]"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=FrontMessage)


def test_step_outputs_round_trip():
    logprob = Logprob(5, -0.25, 1, {5: -0.25, 8: -1.5})
    delta = RequestDelta(
        "req-1",
        [SampleDelta(0, [5], [logprob], "stop", 5), SampleDelta(1, [8, 9], None, None, None)],
        finished=False,
        num_cached_tokens=16,
        prompt_logprobs=[None, logprob],
        first_scheduled_time=12.5,
    )
    message = StepOutputs([delta], None)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=CoreMessage) == message
