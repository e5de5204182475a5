"""The offline API: ``LLM(model).generate(prompts)`` and ``.chat(conversations)``."""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams
from heron.speculative import SpecDecodeStats

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Conversation = list[dict[str, Any]]


class LLM:
    """Generate from a model offline, batching all prompts of a call together.

    ``model`` is a Hugging Face directory, a ``.gguf`` file, or ``None`` for the embedded
    default model; the other keywords are :class:`EngineConfig` options.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        """Proposed and accepted tokens so far, and the mean acceptance length (with a
        ``speculative_config``)."""
        return self.engine.spec_decode_stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order.

        A prompt the engine rejects (empty, longer than the context, unknown token ids) gets an
        output with ``error`` set and no completions; the other prompts still run.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts; pass one or one each"
            )
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, p, stream=False)
            except ValueError as e:
                logger.warning("request %s rejected: %s", request_id, e)
                text, ids = (prompt, []) if isinstance(prompt, str) else (None, list(prompt))
                results[request_id] = RequestOutput(request_id, text, ids, [], True, error=str(e))
        self._run(results, use_tqdm and len(prompts) > 1)
        return [results[request_id] for request_id in order]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``conversation`` through ``chat_template`` (a Jinja template) or, by
        default, the tokenizer's own; ``tools`` (OpenAI's tool definitions) go to the template,
        which decides how the model sees them; ``template_kwargs`` are more variables of the
        template (``enable_thinking`` of Qwen3's, say)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        taken = set(template_kwargs or ()) & set(
            inspect.signature(self.tokenizer.apply_chat_template).parameters
        )
        if taken:
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(sorted(taken))}: "
                "those are arguments of the template call, not template variables"
            )
        text = self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )
        # The template already wrote any BOS token; do not add a second one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, results: dict[str, RequestOutput], show_progress: bool) -> None:
        engine = self.engine
        bar = tqdm(total=engine.num_unfinished_requests, desc="requests", disable=not show_progress)
        start, tokens = time.perf_counter(), 0
        with bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
