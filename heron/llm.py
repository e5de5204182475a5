"""The offline API: ``LLM(model).generate(prompts)`` and ``.chat(conversations)``; for a
pooling model ``.embed``, ``.classify``, ``.score`` and ``.reward``."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from heron.chat_template import Conversation, apply_chat_template
from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine
from heron.engine.output_processor import OutputProcessor
from heron.lora.request import LoRARequest
from heron.multimodal.chat import take_images
from heron.multimodal.inputs import ImageItem
from heron.multimodal.media import MediaPolicy
from heron.multimodal.processor import ImageProcessor
from heron.outputs import PoolingRequestOutput, RequestOutput
from heron.pooler_config import PoolerConfig
from heron.pooling_params import PoolingParams, cosine, pair_token_ids
from heron.sampling_params import SamplingParams
from heron.speculative import SpecDecodeStats

logger = logging.getLogger(__name__)

# A text, token ids, or {"prompt": text | "prompt_token_ids": ids, "multi_modal_data":
# {"image": PIL image | list of them}} (the placeholders in the text, one per image).
Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Generate from a model offline, batching all prompts of a call together.

    ``model`` is a Hugging Face directory, a ``.gguf`` file, or ``None`` for the embedded
    default model; the other keywords are :class:`EngineConfig` options.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._engine: LLMEngine | None = engine
        self.tokenizer = engine.tokenizer
        self._outputs = OutputProcessor(engine.tokenizer, engine.eos_token_ids)
        self._ids = itertools.count()
        self._image_processor: ImageProcessor | None = None
        # Nothing here finalizes the engine: a finalizer holding it would keep alive whatever
        # the engine references (a cycle back to this LLM included) for the process's life. A
        # dropped LLM frees its engine with it, and a tensor-parallel runner's own weak
        # finalizer then stops its workers and leaves the process group.

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM was shut down")
        return self._engine

    def shutdown(self) -> None:
        """Stop the engine: its tensor-parallel workers exit and its process group is left,
        so another tensor-parallel LLM may start in this process. Idempotent."""
        if self._engine is not None:
            self._engine.shutdown()
        self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order; ``lora_request``: the adapter of
        every prompt, or one per prompt (None: the base model).

        A prompt the engine rejects (empty, longer than the context, unknown token ids, an
        adapter that does not fit the model) gets an output with ``error`` set and no
        completions; the other prompts still run.
        """
        if self.engine.rollout.paused:
            raise RuntimeError("generation is paused; call resume_generation() first")
        if self.engine.pooling is not None:
            raise ValueError(
                f"{self.engine.model_config.architecture} is a pooling model: it does not "
                "generate; use LLM.embed, .classify, .score or .reward"
            )
        prompts = _prompt_list(prompts)
        params = _one_each(
            sampling_params or SamplingParams(), SamplingParams, prompts, "sampling params"
        )
        loras = _one_each(lora_request, LoRARequest, prompts, "lora requests")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p, lora in zip(prompts, params, loras):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self.add_request(request_id, prompt, p, stream=False, lora_request=lora)
            except ValueError as e:
                logger.warning("request %s rejected: %s", request_id, e)
                if isinstance(prompt, dict):
                    text, ids = prompt.get("prompt"), list(prompt.get("prompt_token_ids", ()))
                else:
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
        """Apply the model's chat template to each conversation, then generate. Message
        content may be OpenAI content parts: ``text``, ``image_url`` (a data URL) and
        ``image_pil`` (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            conversation, images = take_images(conversation, MediaPolicy())
            ids = self.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
            prompts.append(
                {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------------- pooling models

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        dimensions: int | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (its first ``dimensions`` values, Matryoshka-style;
        normalised as the model says unless ``normalize`` is given)."""
        return self.encode(prompts, PoolingParams("embed", dimensions, normalize), use_tqdm)

    def classify(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities (a classifier's softmax; one label: its
        sigmoid)."""
        return self.encode(prompts, PoolingParams("classify"), use_tqdm)

    def reward(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Each prompt's reward: a reward model's head output as it is."""
        return self.encode(prompts, PoolingParams("encode"), use_tqdm)

    def score(
        self, query: str, documents: str | Sequence[str], use_tqdm: bool = True
    ) -> list[float]:
        """How well each document answers ``query``: a cross-encoder's (classifier's) score of
        the pair, tokenized as the tokenizer joins a text pair; an embedding model's cosine
        similarity of the two embeddings. Raises ``ValueError`` if an input is rejected."""
        documents = [documents] if isinstance(documents, str) else list(documents)
        pooling = self._pooling()
        if pooling.num_labels is None:
            outputs = _checked(self.embed([query, *documents], use_tqdm=use_tqdm))
            return [cosine(outputs[0].data, o.data) for o in outputs[1:]]
        pairs = [pair_token_ids(self.tokenizer, query, d) for d in documents]
        outputs = _checked(self.encode(pairs, PoolingParams("score"), use_tqdm))
        return [o.data[0] for o in outputs]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One :class:`PoolingRequestOutput` per prompt, in order, as ``params`` asks; a
        rejected prompt's has ``error`` set (the others still run); raises ``ValueError`` if
        the model does not serve ``params``."""
        engine = self.engine
        engine.check_pooling_params(params)
        prompts = _prompt_list(prompts)
        results: dict[str, PoolingRequestOutput] = {}
        prompt_ids: dict[str, list[int]] = {}
        for prompt in prompts:
            request_id = str(next(self._ids))
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            prompt_ids[request_id] = ids
            try:
                engine.add_request(request_id, ids, params)
            except ValueError as e:
                results[request_id] = PoolingRequestOutput(request_id, ids, [], str(e))
        show = use_tqdm and len(prompts) > 1
        with tqdm(total=engine.num_unfinished_requests, desc="requests", disable=not show) as bar:
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    request_id = delta.request_id
                    results[request_id] = PoolingRequestOutput(
                        request_id, prompt_ids[request_id], delta.pooled
                    )
                    bar.update(1)
        return [results[request_id] for request_id in prompt_ids]

    def _pooling(self) -> PoolerConfig:
        pooling = self.engine.pooling
        if pooling is None:
            raise ValueError(
                "this model generates text; pooling calls need a pooling model "
                "(LLM(model, runner='pooling'))"
            )
        return pooling

    def apply_chat_template(self, conversation: Conversation, **options: Any) -> list[int]:
        """Token ids of ``conversation`` through this model's chat template; ``options`` are
        :func:`heron.chat_template.apply_chat_template`'s (``add_generation_prompt``, ``tools``,
        ``chat_template``, ``template_kwargs``)."""
        return apply_chat_template(self.tokenizer, conversation, **options)

    # --------------------------------- RL rollouts: sleep, weight updates, pause

    def sleep(self, level: int = 1, abort: bool = False) -> list[RequestOutput]:
        """Give up the device memory (needs ``enable_sleep_mode``): level 1 copies the
        weights to host memory and discards the KV cache, level 2 discards both (load the
        weights after wake-up: :meth:`update_weights`, :meth:`reload_weights`). Refused while
        requests are unfinished unless ``abort``; returns the aborted requests' outputs."""
        return self._process(self.engine.rollout.sleep(level, abort))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back ``tags`` of the memory (``["weights"]``, ``["kv_cache"]``; None: all)."""
        self.engine.rollout.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.rollout.is_sleeping

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], draft: bool = False
    ) -> int:
        """Write ``(name, tensor)`` pairs (full tensors in the checkpoint's naming; any subset;
        an MTP head's among them; ``draft``: the draft model's) into the weights in place.
        Every tensor is checked first: an unknown name, a wrong shape or a non-floating
        tensor raises ``ValueError`` naming it, with no weight changed. Refused while
        requests are unfinished. The prefix cache is reset. Returns the tensors written."""
        return self.engine.rollout.update_weights(named_tensors, draft)

    def reload_weights(self, path: str | None = None, draft: bool = False) -> int:
        """Re-read a checkpoint directory (default: the model's) into the weights in place."""
        return self.engine.rollout.reload_weights(path, draft)

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "nccl",
    ) -> None:
        """Join a trainer's process group for weight broadcasts: the trainer is rank 0
        (:class:`heron.distributed.weight_sync.WeightSender`), this engine ``rank_offset``;
        ``backend``: ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs). Blocks until all ranks join."""
        self.engine.rollout.init_weight_update_group(
            master_address, master_port, rank_offset, world_size, backend
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        draft: bool = False,
    ) -> int:
        """Receive a chunk of tensors the trainer broadcasts (one per name, in this order)
        and write them as :meth:`update_weights` does."""
        return self.engine.rollout.update_weights_from_distributed(names, dtypes, shapes, draft)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return self.engine.rollout.reset_prefix_cache()

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Hold the engine between training steps: ``abort`` the unfinished requests (their
        outputs are returned), or ``keep`` them queued until :meth:`resume_generation`."""
        return self._process(self.engine.rollout.pause_generation(mode))

    def resume_generation(self) -> None:
        self.engine.rollout.resume_generation()

    def _process(self, deltas: list) -> list[RequestOutput]:
        return self._outputs.process(deltas).outputs

    # ------------------------------------------------------- one step at a time

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        stream: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (under ``lora_request``'s adapter, if given); raise ``ValueError``
        (and queue nothing) if it is invalid. With ``stream`` :meth:`step` returns its output
        whenever it advances, else only once finished."""
        images = ()
        if isinstance(prompt, dict):
            text, token_ids, images = self._multimodal_prompt(prompt)
        elif isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        params = params or SamplingParams()
        self.engine.add_request(request_id, token_ids, params, lora_request, images)
        self._outputs.add_request(request_id, text, token_ids, params, stream)

    def _multimodal_prompt(
        self, prompt: dict[str, Any]
    ) -> tuple[str | None, list[int], tuple[ImageItem, ...]]:
        """A dict prompt's text, its token ids with the image placeholders expanded, and its
        images."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"prompt: unknown keys {', '.join(sorted(unknown))}")
        text = prompt.get("prompt")
        ids = self.tokenizer.encode(text) if text is not None else prompt.get("prompt_token_ids")
        if ids is None:
            raise ValueError("prompt: needs 'prompt' (text) or 'prompt_token_ids'")
        data = dict(prompt.get("multi_modal_data") or {})
        images = data.pop("image", [])
        if data:
            raise ValueError(
                f"multi_modal_data: {', '.join(sorted(data))} not supported (images only)"
            )
        images = images if isinstance(images, (list, tuple)) else [images]
        if not images:
            return text, list(ids), ()
        self.engine.validate_images(len(images))
        if self._image_processor is None:
            config = self.engine.model_config
            self._image_processor = ImageProcessor(config.path, config.hf_config)
        token_ids, items = self._image_processor.process(ids, images)
        return text, token_ids, items

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests it advanced."""
        engine = self.engine
        processed = self._outputs.process(engine.step())
        for abort in processed.aborts:  # samples a stop string ended
            engine.abort_request(abort.request_id, abort.sample_index)
        return processed.outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its final output (None for an unknown or finished id)."""
        delta = self.engine.abort_request(request_id)
        if delta is None:
            return None
        outputs = self._outputs.process([delta]).outputs
        return outputs[0] if outputs else None

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _run(self, results: dict[str, RequestOutput], show_progress: bool) -> None:
        engine = self.engine
        bar = tqdm(total=engine.num_unfinished_requests, desc="requests", disable=not show_progress)
        start, tokens = time.perf_counter(), 0
        with bar:
            while engine.has_unfinished_requests():
                for output in self.step():
                    if output.finished:
                        results[output.request_id] = output
                        tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")


def _one_each(value: Any, single: type, prompts: Sequence[Prompt], what: str) -> list[Any]:
    """``value`` for every prompt (one ``single``, or None), or its items, one per prompt."""
    if value is None or isinstance(value, single):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(
            f"got {len(value)} {what} for {len(prompts)} prompts; pass one or one each"
        )
    return list(value)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> Sequence[Prompt]:
    """One prompt (a string, token ids or a dict) as a list of one."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts


def _checked(outputs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
    for output in outputs:
        if output.error is not None:
            raise ValueError(output.error)
    return outputs
