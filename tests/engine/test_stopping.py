"""check_stop: each way a request can end after its newest token, and their precedence."""

from __future__ import annotations

from heron.engine.request import FinishReason, Request
from heron.engine.stopping import check_stop
from heron.sampling_params import SamplingParams

EOS = 2
STOP_TOKEN = 9
MAX_MODEL_LEN = 64


def after(output: list[int], prompt_len: int = 4, **params) -> Request:
    """A request whose output is ``output`` (its last token being the new one)."""
    params.setdefault("eos_token_ids", frozenset({EOS}))
    request = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(**params))
    for token in output:
        request.append_output_token(token)
    return request


def check(request: Request, stop_string: str | None = None):
    return check_stop(request, request.output_token_ids[-1], stop_string, MAX_MODEL_LEN)


def test_running_request_continues():
    assert check(after([5, 6])) is None


def test_eos_stops_without_reason():
    assert check(after([5, EOS])) == (FinishReason.STOP, None)


def test_eos_ignored_when_asked():
    assert check(after([5, EOS], ignore_eos=True)) is None


def test_eos_and_stop_tokens_wait_for_min_tokens():
    assert check(after([EOS], min_tokens=2)) is None
    assert check(after([STOP_TOKEN], min_tokens=2, stop_token_ids=[STOP_TOKEN])) is None
    assert check(after([5, EOS], min_tokens=2)) == (FinishReason.STOP, None)


def test_stop_token_gives_its_id():
    request = after([5, STOP_TOKEN], stop_token_ids=[STOP_TOKEN])
    assert check(request) == (FinishReason.STOP, STOP_TOKEN)


def test_stop_string_gives_the_string():
    assert check(after([5, 6], stop=["ab"]), stop_string="ab") == (FinishReason.STOP, "ab")


def test_max_tokens_is_length():
    assert check(after([5, 6, 7], max_tokens=3)) == (FinishReason.LENGTH, None)
    assert check(after([5, 6], max_tokens=3)) is None


def test_context_full_is_length():
    request = after([5, 6], prompt_len=MAX_MODEL_LEN - 2, max_tokens=None)
    assert check(request) == (FinishReason.LENGTH, None)


def test_stop_takes_precedence_over_length():
    assert check(after([5, EOS], max_tokens=2)) == (FinishReason.STOP, None)
    assert check(after([5, 6], max_tokens=2), stop_string="x") == (FinishReason.STOP, "x")
