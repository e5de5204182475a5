"""What the runner keeps of each request between steps, fed only by step plans."""

from __future__ import annotations

import torch

from heron.execution.step_plan import NewRequest
from heron.sampling_params import SamplingParams


class RequestState:
    """A request's tokens (the prompt, then what this runner sampled), sampling parameters and
    seeded generator; the sampler reads it as it would an engine request.

    It outlives a preemption (the request returns with new tables and resumes its draws).
    """

    __slots__ = (
        "request_id",
        "all_token_ids",
        "num_prompt_tokens",
        "sampling_params",
        "generator",
        "num_prompt_logprobs",
        "lora_request",
        "images",
    )

    def __init__(self, new: NewRequest, device: torch.device) -> None:
        self.request_id = new.request_id
        self.all_token_ids = list(new.token_ids)
        self.num_prompt_tokens = new.num_prompt_tokens
        self.sampling_params: SamplingParams = new.sampling_params
        self.generator = None if new.seed is None else torch.Generator(device).manual_seed(new.seed)
        # Prompt positions whose next-token logprob was computed (a recomputed prompt after a
        # preemption does not compute them twice).
        self.num_prompt_logprobs = 0
        self.lora_request = new.lora_request
        self.images = new.images

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None
