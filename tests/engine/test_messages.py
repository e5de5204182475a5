"""What the front and the engine core send each other survives msgpack unchanged."""

from __future__ import annotations

from dataclasses import fields

import msgspec
import pytest

from heron.engine.messages import (
    AddRequest,
    CoreMessage,
    FrontMessage,
    RequestDelta,
    SampleDelta,
    StepOutputs,
)
from heron.outputs import Logprob
from heron.sampling_params import SamplingParams

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
    "eos_token_ids": frozenset({2, 151645}),
}


def test_every_sampling_param_round_trips():
    assert set(NON_DEFAULT) == {f.name for f in fields(SamplingParams)}, "a new field: add it"
    params = SamplingParams(**NON_DEFAULT)
    default = SamplingParams()
    assert all(getattr(params, k) != getattr(default, k) for k in NON_DEFAULT)
    message = AddRequest("req-1", [1, 2, 3], params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=FrontMessage)
    assert decoded == message
    assert isinstance(decoded.params.eos_token_ids, frozenset)


def test_decoding_validates_sampling_params():
    encoded = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams()))
    wire = msgspec.msgpack.decode(encoded)  # as plain data: [tag, id, ids, params]
    wire[-1]["n"] = 0
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
