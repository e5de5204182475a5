"""Whether a request is finished after its newest token."""

from __future__ import annotations

from heron.engine.request import FinishReason, Request
from heron.sampling_params import SamplingParams


def stop_token_reason(
    params: SamplingParams, token_id: int, num_output_tokens: int
) -> tuple[FinishReason, int | None] | None:
    """``(STOP, stop_reason)`` when ``token_id`` ends the output as EOS or a stop token.

    ``num_output_tokens`` counts the token itself. Before ``min_tokens`` neither ends it (the
    sampler masks both until then). Also used by the detokenizer to leave such a token's text
    out of the output.
    """
    if num_output_tokens < params.min_tokens:
        return None
    if token_id in params.eos_token_ids and not params.ignore_eos:
        return FinishReason.STOP, None
    if token_id in params.stop_token_ids:
        return FinishReason.STOP, token_id
    return None


def check_stop(
    request: Request, new_token_id: int, stop_string: str | None, max_model_len: int
) -> tuple[FinishReason, str | int | None] | None:
    """The finish reason and stop reason after ``new_token_id`` was appended, or None.

    ``stop_string`` is what the detokenizer's ``append`` returned for this token.
    """
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)
    reason = stop_token_reason(params, new_token_id, num_output_tokens)
    if reason is not None:
        return reason
    if stop_string is not None:
        return FinishReason.STOP, stop_string
    max_tokens_reached = params.max_tokens is not None and num_output_tokens >= params.max_tokens
    # Known tokens only: a token still being sampled (asynchronous scheduling) is not counted.
    if max_tokens_reached or len(request.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH, None
    return None
