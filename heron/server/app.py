"""The OpenAI-compatible HTTP API over an :class:`EngineCoreClient`."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import fields, replace
from itertools import islice
from typing import Any, TypeVar

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from heron import __version__, envs
from heron.chat_template import apply_chat_template
from heron.engine.core_client import (
    ControlArgumentError,
    ControlConflictError,
    EngineCoreClient,
    EngineDeadError,
    EngineUnavailableError,
    StepError,
)
from heron.engine.request import Logprob
from heron.lora.request import LoRARequest
from heron.multimodal.inputs import ImageItem
from heron.multimodal.media import MediaPolicy
from heron.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from heron.pooling_params import PoolingParams, cosine, pair_token_ids
from heron.sampling_params import SamplingParams
from heron.server.chat_output import ChatOutputConfig, ChatOutputParser
from heron.server.disconnect import ClientDisconnected, until_disconnect, wait_for_disconnect
from heron.server.images import ServerImages
from heron.server.metrics import ServerMetrics
from heron.server.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingBody,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    classification_response,
    embeddings_response,
    pooling_response,
    rerank_response,
    score_response,
)
from heron.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UnloadLoRAAdapterRequest,
    UnsupportedFieldError,
    Usage,
)
from heron.server.reasoning import reasoning_tokens
from heron.server.request_body import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    BodyTooLargeError,
    UnsupportedMediaTypeError,
    off_loop_if_large,
    parse_body,
)
from heron.server.responses import (
    Event,
    ResponseStore,
    ResponseWriter,
    new_response,
    output_turn,
    reasoning_token_count,
)
from heron.server.responses_protocol import ResponsesRequest
from heron.server.rollout_routes import rollout_router
from heron.server.structured_protocol import DeltaFunctionCall, DeltaToolCall
from heron.server.tool_parsers import ToolCallDelta, join_tool_calls

logger = logging.getLogger(__name__)

# A ValueError whose message starts with one of these names is about that field.
_FIELDS = (
    {f.name for f in fields(SamplingParams)}
    | set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | set(ResponsesRequest.model_fields)
    | set(EmbeddingRequest.model_fields)
)
# The routes that serve each pooling task (a refusal names those the model serves).
_POOLING_ROUTES = {
    "embed": "/v1/embeddings",
    "classify": "/classify",
    "score": "/score, /rerank",
    "encode": "/pooling",
}
_GENERATION_ROUTES = "/v1/completions, /v1/chat/completions or /v1/responses"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    info = ErrorInfo(
        message=message,
        type=_ERROR_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


def _bad_value(e: ValueError) -> APIError:
    """A 400 for a rejected value; SamplingParams messages start with the field's name."""
    if isinstance(e, UnsupportedFieldError):
        return APIError(400, str(e), param=e.name, code="unsupported_field")
    first_word = str(e).split(" ", 1)[0]
    return APIError(400, str(e), param=first_word if first_word in _FIELDS else None)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


T = TypeVar("T")


class OpenAIServing:
    """State and request handling shared by the endpoints of one app."""

    def __init__(
        self,
        engine: EngineCoreClient,
        served_model_name: str,
        max_request_body_bytes: int,
        trust_request_chat_template: bool,
        chat_output: ChatOutputConfig | None = None,
        chat_template: str | None = None,
        media: MediaPolicy | None = None,
        image_limit: int | None = None,
    ) -> None:
        """``chat_template``: the server's, used when a request brings none (None: the
        tokenizer's); ``media``: where images may come from; ``image_limit``: most images a
        prompt (None: no limit)."""
        self.engine = engine
        self.images = ServerImages(engine.model_path, media or MediaPolicy(), image_limit)
        self.chat_template = chat_template
        self.chat_output = chat_output or ChatOutputConfig()
        self.tokenizer = engine.tokenizer
        parser = self.chat_output.reasoning_parser
        self.reasoning_tokens = reasoning_tokens(parser, self.tokenizer) if parser else None
        self.model_name = served_model_name
        self.adapters: dict[str, LoRARequest] = {}  # LoRA adapters served, by model name
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(lambda: engine.stats)
        self.max_request_body_bytes = max_request_body_bytes
        self.trust_request_chat_template = trust_request_chat_template
        # No token covers more characters than its vocabulary string has (byte-level and
        # SentencePiece vocabularies), so a longer text cannot fit in the context: refusing it
        # spares the tokenizer a multi-megabyte prompt.
        longest_token = max(map(len, self.tokenizer.get_vocab()))
        self.max_prompt_chars = self.max_model_len * longest_token
        # One thread: a fast tokenizer must not be entered by two threads that could change
        # its settings; the event loop only decodes.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="heron-tokenize")

    def output_parser(self, body: ChatCompletionRequest) -> ChatOutputParser:
        """A fresh parser of one choice's text (reasoning, tool calls) for this request."""
        return ChatOutputParser(self.chat_output, body.tools, body.effective_tool_choice)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.adapters:
            served = ", ".join(map(repr, [self.model_name, *self.adapters]))
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        self.check_model(model)
        return self.adapters.get(model) if model is not None else None

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as model ``name`` (the core reads and checks it)."""
        if name == self.model_name:
            raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
        try:
            self.adapters[name] = await self.engine.add_lora(name, path)
        except ValueError as e:
            raise _bad_value(e) from e

    # ---------------------------------------------------------------- request input

    async def parse(self, request: Request, model: type[T]) -> T:
        return await parse_body(request, model, self.max_request_body_bytes)

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        self.check_model(body.model)
        if self.engine.pooling is not None:
            routes = ", ".join(_POOLING_ROUTES[t] for t in self.engine.pooling.tasks)
            raise APIError(
                400,
                f"this server's model is a pooling model: it generates no text; use {routes}",
                code="wrong_model_type",
            )
        try:
            body.check_supported()
            return body.sampling_params()
        except ValueError as e:
            raise _bad_value(e) from e

    def chat_sampling_params(self, body: ChatCompletionRequest) -> SamplingParams:
        """:meth:`sampling_params` under the server's tool-call and reasoning settings: a
        grammar (of the request or of a forced tool call) starts after the reasoning."""
        params = self.sampling_params(body)
        if params.structured_outputs is not None and self.reasoning_tokens is not None:
            params.structured_outputs = replace(
                params.structured_outputs, reasoning=self.reasoning_tokens
            )
        has_tools, choice = bool(body.tools), body.effective_tool_choice
        try:
            self.chat_output.check_tool_choice(has_tools, choice)
        except ValueError as e:
            raise _bad_value(e) from e
        if self.chat_output.keeps_special_tokens(has_tools, choice):
            params.skip_special_tokens = False
        return params

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters, more than the context length "
                f"(max_model_len={self.max_model_len}) can hold in tokens of this tokenizer "
                f"(at most {self.max_prompt_chars} characters)",
            )

    async def tokenize(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """Token ids of every prompt (text is tokenized, large text off the event loop)."""
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.check_prompt_chars(len(text))
        size = sum(map(len, texts))
        return await off_loop_if_large(
            size,
            lambda: [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts],
            self.tokenizer_thread,
        )

    async def chat_prompt(
        self, body: ChatCompletionRequest | TokenizeRequest
    ) -> tuple[list[int], tuple[ImageItem, ...]]:
        """The conversation through the chat template (the request's own, if it has one),
        and its images (their placeholders expanded in the token ids)."""
        conversation, tools, images = body.conversation(), None, []
        if any(isinstance(m["content"], list) for m in conversation):
            try:
                conversation, images = await asyncio.to_thread(self.images.take, conversation)
            except ValueError as e:
                raise _bad_value(e) from e
        size = sum(len(m["content"]) for m in conversation if isinstance(m["content"], str))
        if isinstance(body, ChatCompletionRequest):
            self.check_prompt_chars(size)  # the template writes every message's content
            tools = body.template_tools()
        if body.chat_template is not None:
            if not self.trust_request_chat_template:
                # As vLLM: a client's template is code the server runs (sandboxed, but its
                # loops are unbounded), so the operator has to allow it.
                raise APIError(
                    400,
                    "chat_template from requests is refused; start the server with "
                    "--trust-request-chat-template to allow it",
                    param="chat_template",
                )
            size = math.inf  # its cost is not the input's: never on the event loop
        template = self.chat_template if body.chat_template is None else body.chat_template

        def render() -> list[int]:
            return apply_chat_template(
                self.tokenizer,
                conversation,
                body.add_generation_prompt,
                tools,
                template,
                body.chat_template_kwargs,
            )

        try:
            token_ids = await off_loop_if_large(size, render, self.tokenizer_thread)
            if not images:
                return token_ids, ()
            return await asyncio.to_thread(self.images.process, token_ids, images)
        except jinja2.TemplateError as e:
            raise APIError(400, f"the chat template failed: {e}", param="chat_template") from e
        except ValueError as e:
            raise _bad_value(e) from e

    def check_context(
        self, num_prompt_tokens: int, body: CompletionRequest | ChatCompletionRequest
    ) -> None:
        """Refuse a prompt that leaves no room for a new token, and ``max_tokens`` that would
        run past the context, as vLLM does (a prompt that alone is too long is refused by the
        engine)."""
        max_tokens, limit = body.requested_max_tokens, self.max_model_len
        if num_prompt_tokens == limit:
            raise APIError(
                400,
                f"the prompt's {num_prompt_tokens} tokens fill the context length "
                f"(max_model_len={limit}): no new token fits",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        if max_tokens is None or num_prompt_tokens > limit:
            return
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"{body.max_tokens_field}={max_tokens} and the prompt's {num_prompt_tokens} "
                f"tokens are more than the context length (max_model_len={limit}); at most "
                f"{limit - num_prompt_tokens} new tokens fit",
                param=body.max_tokens_field,
            )

    # ---------------------------------------------------------------- generation

    async def start(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageItem, ...] = (),
    ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """Add every prompt (under ``lora_request``'s adapter; a chat's one prompt with its
        ``images``) and wait for its first output, so invalid prompts fail before any response
        is sent. Returns each prompt's first output and the rest of its stream."""
        streams = [
            self.metrics.track(
                self.engine.generate(f"{request_id}-{i}", prompt, params, lora_request, images)
            )
            for i, prompt in enumerate(prompts)
        ]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await asyncio.gather(*(s.aclose() for s in streams))
            if isinstance(errors[0], ValueError):
                raise _bad_value(errors[0])
            raise errors[0]
        return list(zip(firsts, streams))

    async def merge(
        self,
        request: Request,
        started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts as they come, tagged with the prompt's index.

        Raises :class:`ClientDisconnected` when the client goes away; leaving this generator
        (for any reason) cancels the per-prompt streams, which aborts their requests.
        """
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, first: RequestOutput, rest: AsyncIterator[RequestOutput]):
            queue.put_nowait((index, first))
            try:
                async for output in rest:
                    queue.put_nowait((index, output))
            except Exception as e:
                queue.put_nowait((index, e))
            queue.put_nowait((index, None))

        async def watch() -> None:
            await wait_for_disconnect(request)
            queue.put_nowait((-1, ClientDisconnected()))

        tasks = [asyncio.ensure_future(pump(i, *s)) for i, s in enumerate(started)]
        tasks.append(asyncio.ensure_future(watch()))
        remaining = len(started)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- formatting

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(
        self, entries: Sequence[tuple[int, Logprob | None]], offset: int, num_top: int
    ) -> CompletionLogprobs:
        """OpenAI's logprobs of ``(token id, logprob)`` pairs with ``num_top`` alternatives each;
        a prompt's first token has no logprob (``None``)."""
        result = CompletionLogprobs()
        for token_id, lp in entries:
            token = self._token(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(None if lp is None else lp.logprob)
            result.top_logprobs.append(
                None if lp is None else {self._token(t): v for t, v in _top(lp, num_top)}
            )
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def chat_logprobs(self, logprobs: list[Logprob]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            token = self._token(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for lp in logprobs:
            top = sorted(lp.top.items(), key=lambda kv: -kv[1])
            chosen = entry(lp.token_id, lp.logprob)
            content.append(
                ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[entry(*kv) for kv in top])
            )
        return ChatLogprobs(content=content)

    def prompt_logprobs(self, output: RequestOutput, num_top: int | None) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs``: per prompt token its own and the ``num_top`` likeliest."""
        if num_top is None:
            return None
        result: PromptLogprobs = []
        for token_id, lp in _prompt_entries(output):
            if lp is None:
                result.append(None)
                continue
            entry = {
                str(t): PromptLogprob(logprob=v, rank=rank, decoded_token=self._token(t))
                for rank, (t, v) in enumerate(_top(lp, num_top), start=1)
            }
            entry[str(token_id)] = PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=self._token(token_id)
            )
            result.append(entry)
        return result

    # ---------------------------------------------------------------- pooling

    async def pool(
        self,
        request: Request,
        route: str,
        body: PoolingBody,
        prompts: Sequence[str | list[int]],
        params: PoolingParams,
        param: str = "input",
    ) -> tuple[str, list[PoolingRequestOutput]]:
        """The request's id and every prompt's pooled answer, once all are done; ``param``
        names the field of the inputs (refusals of one name it)."""
        self.check_model(body.model)
        pooling = self.engine.pooling
        if pooling is None:
            raise APIError(
                400,
                f"{route} needs a pooling model; this server's model generates text: use "
                f"{_GENERATION_ROUTES}",
                code="wrong_model_type",
            )
        if params.task not in pooling.tasks:
            routes = ", ".join(_POOLING_ROUTES[t] for t in pooling.tasks)
            raise APIError(
                400,
                f"this server's model does not serve {route}; it serves {routes}",
                code="wrong_model_type",
            )
        try:
            pooling.check(params)
        except ValueError as e:
            raise _bad_value(e) from e
        limit = envs.max_pooling_inputs()
        if len(prompts) > limit:
            raise APIError(
                400,
                f"{len(prompts)} inputs are more than one request may carry ({limit}; "
                "HERON_MAX_POOLING_INPUTS)",
                param=param,
            )
        token_ids = await self.tokenize(prompts)
        request_id = f"{route.rsplit('/', 1)[-1]}-{uuid.uuid4().hex}"
        work = asyncio.gather(
            *(
                self.engine.pool(f"{request_id}-{i}", ids, params)
                for i, ids in enumerate(token_ids)
            ),
            return_exceptions=True,
        )
        outputs = await until_disconnect(request, work)
        for output in outputs:
            if isinstance(output, ValueError):
                raise APIError(400, str(output), param=param)
            if isinstance(output, BaseException):
                raise output
        return request_id, outputs

    async def score(
        self,
        request: Request,
        route: str,
        body: PoolingBody,
        query: str,
        documents: list[str],
        param: str,
    ) -> tuple[str, list[float], list[PoolingRequestOutput]]:
        """The request's id, how well each document answers ``query`` (a cross-encoder's
        score of the pair, an embedding model's cosine similarity), and the pooled outputs."""
        pooling = self.engine.pooling
        if pooling is not None and pooling.num_labels is None:
            prompts, params = [query, *documents], PoolingParams("embed")
            request_id, outputs = await self.pool(request, route, body, prompts, params, param)
            return request_id, [cosine(outputs[0].data, o.data) for o in outputs[1:]], outputs
        for document in documents:
            self.check_prompt_chars(len(query) + len(document))
        pairs = await off_loop_if_large(
            sum(map(len, documents)),
            lambda: [pair_token_ids(self.tokenizer, query, d) for d in documents],
            self.tokenizer_thread,
        )
        params = PoolingParams("score")
        request_id, outputs = await self.pool(request, route, body, pairs, params, param)
        return request_id, [o.data[0] for o in outputs], outputs

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


class _Deltas:
    """What of each sample's text and logprobs a stream has already sent."""

    def __init__(self) -> None:
        self.text: dict[tuple[int, int], int] = {}
        self.tokens: dict[tuple[int, int], int] = {}
        self.done: set[tuple[int, int]] = set()

    def take(
        self, key: tuple[int, int], sample: CompletionOutput
    ) -> tuple[str, list[Logprob], bool] | None:
        """The new text and logprobs of ``sample`` and whether it finished; None: nothing new."""
        if key in self.done:
            return None
        sent_text, sent_tokens = self.text.get(key, 0), self.tokens.get(key, 0)
        delta = sample.text[sent_text:]
        if not delta and not sample.finished:
            # Hold back logprobs of tokens whose text is not complete yet; they go out with it.
            return None
        self.text[key] = len(sample.text)
        self.tokens[key] = len(sample.token_ids)
        if sample.finished:
            self.done.add(key)
        return delta, (sample.logprobs or [])[sent_tokens:], sample.finished


def _api_key_checker(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    return check


def build_app(
    engine: EngineCoreClient,
    served_model_name: str,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    trust_request_chat_template: bool = False,
    chat_output: ChatOutputConfig | None = None,
    chat_template: str | None = None,
    lora_modules: Sequence[tuple[str, str]] = (),
    media: MediaPolicy | None = None,
    image_limit: int | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``served_model_name``; ``api_key`` guards /v1;
    ``chat_output`` names the reasoning and tool-call parsers of chat replies;
    ``chat_template`` replaces the tokenizer's; ``lora_modules``: LoRA adapters served from
    the start, ``(name, path)`` (a request selects one by its ``model``); ``media`` and
    ``image_limit``: where a request's images may come from, and how many a prompt holds.

    Routes read their bodies themselves (:meth:`OpenAIServing.parse`), so the API key is
    checked before a body is read and the size limit holds while it is read.
    """
    serving = OpenAIServing(
        engine,
        served_model_name,
        max_request_body_bytes,
        trust_request_chat_template,
        chat_output,
        chat_template,
        media,
        image_limit,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for name, path in lora_modules:
            await serving.load_adapter(name, path)
        yield
        # Joining the engine core blocks; keep the loop free to deliver the final outputs.
        await asyncio.to_thread(engine.shutdown)
        serving.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Heron", version=__version__, lifespan=lifespan)
    app.state.serving = serving
    _add_error_handlers(app)
    api = APIRouter(dependencies=[Depends(_api_key_checker(api_key))])

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine is not running")
        if engine.sleep_mode and await engine.control("is_sleeping"):
            return JSONResponse({"status": "sleeping"})
        return Response(status_code=200)

    if engine.sleep_mode:
        app.include_router(rollout_router(engine, serving.parse, api.dependencies))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @api.get("/kv_transfer")
    async def kv_transfer() -> Response:
        """What a router passes to a decode instance for a transfer from this one."""
        if engine.kv_transfer is None:
            return error_response(404, "this instance runs no KV connector with a handshake")
        return JSONResponse(engine.kv_transfer)

    card = ModelCard(
        id=served_model_name, root=engine.model_path, max_model_len=serving.max_model_len
    )

    def adapter_card(lora: LoRARequest) -> ModelCard:
        return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=served_model_name)

    @api.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card, *map(adapter_card, serving.adapters.values())])

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        lora = serving.lora_request(model_id)
        return card if lora is None else adapter_card(lora)

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await serving.parse(request, LoadLoRAAdapterRequest)
        if body.lora_name in serving.adapters:
            raise APIError(
                400, f"LoRA adapter {body.lora_name!r} is already loaded", param="lora_name"
            )
        await serving.load_adapter(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter {body.lora_name!r} added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await serving.parse(request, UnloadLoRAAdapterRequest)
        if serving.adapters.pop(body.lora_name, None) is None:
            raise APIError(404, f"no LoRA adapter {body.lora_name!r} is loaded", param="lora_name")
        engine.remove_lora(body.lora_name)
        return Response(f"Success: LoRA adapter {body.lora_name!r} removed successfully.")

    @api.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        body = await serving.parse(request, TokenizeRequest)
        serving.check_model(body.model)
        if body.messages is not None:
            tokens, _ = await serving.chat_prompt(body)
        elif body.prompt is not None:
            tokens = await off_loop_if_large(
                len(body.prompt),
                lambda: serving.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens
                ),
                serving.tokenizer_thread,
            )
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len
        )

    @api.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = await serving.parse(request, DetokenizeRequest)
        serving.check_model(body.model)
        size = len(serving.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise APIError(
                400, f"token id {bad} is outside the vocabulary [0, {size})", param="tokens"
            )
        text = await off_loop_if_large(
            len(body.tokens),
            lambda: serving.tokenizer.decode(body.tokens),
            serving.tokenizer_thread,
        )
        return DetokenizeResponse(prompt=text)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await serving.parse(request, CompletionRequest)
        params = serving.sampling_params(body)
        lora = serving.lora_request(body.model)
        prompts = body.prompts()
        token_ids = await serving.tokenize(prompts)
        for ids in token_ids:
            serving.check_context(len(ids), body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        started = await until_disconnect(
            request, serving.start(request_id, token_ids, params, lora)
        )
        created = int(time.time())
        echoes = [
            (p if isinstance(p, str) else serving.tokenizer.decode(p)) if body.echo else ""
            for p in prompts
        ]
        if body.stream:
            return _streaming(
                _completion_stream(
                    serving, request, body, request_id, created, started, echoes, params.n
                )
            )
        finals = await _final_outputs(serving, request, started)
        choices = []
        for i, output in enumerate(finals):
            for sample in output.outputs:
                logprobs = None
                if sample.logprobs is not None:
                    entries = _entries(sample.logprobs)
                    if body.echo:
                        entries = _prompt_entries(output) + entries
                    logprobs = serving.completion_logprobs(entries, 0, body.logprobs)
                choices.append(
                    CompletionChoice(
                        index=i * params.n + sample.index,
                        text=echoes[i] + sample.text,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                        prompt_logprobs=serving.prompt_logprobs(output, body.prompt_logprobs),
                    )
                )
        return JSONResponse(
            CompletionResponse(
                id=request_id,
                created=created,
                model=served_model_name,
                choices=choices,
                usage=serving.usage(finals),
                kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
            ).model_dump()
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await serving.parse(request, ChatCompletionRequest)
        params = serving.chat_sampling_params(body)
        prompt, images = await serving.chat_prompt(body)
        serving.check_context(len(prompt), body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        lora = serving.lora_request(body.model)
        started = await until_disconnect(
            request, serving.start(request_id, [prompt], params, lora, images)
        )
        created = int(time.time())
        if body.stream:
            return _streaming(
                _chat_stream(serving, request, body, request_id, created, started, params.n)
            )
        (output,) = await _final_outputs(serving, request, started)
        choices = []
        for sample in output.outputs:
            piece = serving.output_parser(body).whole(sample.text)
            choices.append(
                ChatChoice(
                    index=sample.index,
                    message=AssistantMessage(
                        content=piece.content or (None if piece.tool_calls else ""),
                        reasoning_content=piece.reasoning or None,
                        tool_calls=join_tool_calls(piece.tool_calls),
                    ),
                    logprobs=serving.chat_logprobs(sample.logprobs)
                    if sample.logprobs is not None
                    else None,
                    finish_reason=_chat_finish_reason(sample.finish_reason, bool(piece.tool_calls)),
                )
            )
        return JSONResponse(
            ChatCompletionResponse(
                id=request_id,
                created=created,
                model=served_model_name,
                choices=choices,
                usage=serving.usage([output]),
                prompt_logprobs=serving.prompt_logprobs(output, body.prompt_logprobs),
                kv_transfer_params=output.kv_transfer_params,
            ).model_dump()
        )

    responses = ResponseStore(envs.responses_store_size(), envs.responses_store_max_age_s())

    def stored(response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = responses.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"no response {response_id!r} is stored (this server keeps the last "
                f"{responses.max_size} for {responses.max_age_s:g} s)",
                param=param,
            )
        return entry

    @api.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await serving.parse(request, ResponsesRequest)
        try:
            body.check_supported()
        except ValueError as e:
            raise _bad_value(e) from e
        history = []
        if body.previous_response_id is not None:
            history = stored(body.previous_response_id, "previous_response_id")[1]
        try:
            chat = body.chat_request(history)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from e
        except ValueError as e:
            raise _bad_value(e) from e
        params = serving.chat_sampling_params(chat)
        prompt, images = await serving.chat_prompt(chat)
        serving.check_context(len(prompt), chat)
        response_id = f"resp_{uuid.uuid4().hex}"
        lora = serving.lora_request(chat.model)
        started = await until_disconnect(
            request, serving.start(response_id, [prompt], params, lora, images)
        )
        writer = ResponseWriter(new_response(body, response_id, served_model_name))
        parser = serving.output_parser(chat)
        conversation = [*history, *body.messages()]

        def finish(output: RequestOutput) -> list[Event]:
            (sample,) = output.outputs
            events = writer.feed(parser.finish())
            reasoning = reasoning_token_count(sample.token_ids, serving.reasoning_tokens)
            events += writer.finish(sample.finish_reason, serving.usage([output]), reasoning)
            if body.store:
                responses.put(
                    writer.response, [*conversation, output_turn(writer.response["output"])]
                )
            return events

        if body.stream:
            return _streaming(_responses_stream(request, serving, started, writer, parser, finish))
        (output,) = await _final_outputs(serving, request, started)
        writer.feed(parser.feed(output.outputs[0].text))
        finish(output)
        return JSONResponse(writer.response)

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return JSONResponse(stored(response_id)[0])

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        stored(response_id)
        responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @api.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await serving.parse(request, EmbeddingRequest)
        params = PoolingParams("embed", body.dimensions)
        _, outputs = await serving.pool(request, "/v1/embeddings", body, body.inputs(), params)
        return JSONResponse(embeddings_response(outputs, served_model_name, body.encoding_format))

    @api.post("/pooling")
    async def pooling(request: Request) -> Response:
        body = await serving.parse(request, PoolingRequest)
        params = PoolingParams("encode")
        request_id, outputs = await serving.pool(request, "/pooling", body, body.inputs(), params)
        return JSONResponse(pooling_response(request_id, served_model_name, outputs))

    @api.post("/classify")
    async def classify(request: Request) -> Response:
        body = await serving.parse(request, ClassificationRequest)
        params = PoolingParams("classify")
        request_id, outputs = await serving.pool(request, "/classify", body, body.inputs(), params)
        labels = engine.pooling.labels
        return JSONResponse(classification_response(request_id, served_model_name, outputs, labels))

    @api.post("/score")
    async def score(request: Request) -> Response:
        body = await serving.parse(request, ScoreRequest)
        request_id, scores, outputs = await serving.score(
            request, "/score", body, body.text_1, body.documents(), "text_2"
        )
        return JSONResponse(score_response(request_id, served_model_name, scores, outputs))

    @api.post("/rerank")
    @api.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        body = await serving.parse(request, RerankRequest)
        request_id, scores, outputs = await serving.score(
            request, "/rerank", body, body.query, body.documents, "documents"
        )
        return JSONResponse(rerank_response(request_id, served_model_name, body, scores, outputs))

    app.include_router(api)
    return app


def _delta_tool_call(delta: ToolCallDelta) -> DeltaToolCall:
    first = delta.id is not None
    return DeltaToolCall(
        index=delta.index,
        id=delta.id,
        type="function" if first else None,
        function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments),
    )


def _chat_finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's reason for a reply that ended by calling tools."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


def _entries(logprobs: Sequence[Logprob]) -> list[tuple[int, Logprob | None]]:
    return [(lp.token_id, lp) for lp in logprobs]


def _prompt_entries(output: RequestOutput) -> list[tuple[int, Logprob | None]]:
    """The prompt's logprobs (the first None), when they were asked for."""
    if output.prompt_logprobs is None:
        return []
    return list(zip(output.prompt_token_ids, output.prompt_logprobs))


def _top(lp: Logprob, n: int) -> list[tuple[int, float]]:
    """The ``n`` likeliest alternatives (``lp.top`` is in descending order and may hold more,
    when prompt logprobs were asked for with a larger count)."""
    return list(islice(lp.top.items(), n))


async def _final_outputs(
    serving: OpenAIServing,
    request: Request,
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
) -> list[RequestOutput]:
    """The finished output of every prompt (a disconnect aborts them all)."""
    finals: dict[int, RequestOutput] = {}
    async for index, output in serving.merge(request, started):
        if output.finished:
            finals[index] = output
    return [finals[i] for i in range(len(started))]


def _streaming(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream")


async def _sse_events(
    serving: OpenAIServing,
    request: Request,
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
    include_usage: bool,
    usage_chunk: Any,
) -> AsyncIterator[tuple[int, RequestOutput] | str]:
    """Drive a stream: yield outputs to format, then the usage chunk and ``[DONE]`` as text.

    A failed step ends the stream with an error event; a disconnect ends it silently (the merge
    has aborted the requests by then).
    """
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in serving.merge(request, started):
            if output.finished:
                finals[index] = output
            yield index, output
    except (ClientDisconnected, asyncio.CancelledError, GeneratorExit) as e:
        # Seen by the merge, or by Starlette, which then cancels or closes the stream.
        logger.info("client left a stream; its requests were aborted")
        if isinstance(e, ClientDisconnected):
            return
        raise
    except (StepError, EngineDeadError) as e:
        info = ErrorInfo(message=str(e), type=_ERROR_TYPES[500])
        yield _sse(ErrorResponse(error=info).model_dump_json())
    else:
        if include_usage:
            usage = serving.usage([finals[i] for i in range(len(started))])
            yield _sse(usage_chunk(usage).model_dump_json())
    yield _sse("[DONE]")


async def _completion_stream(
    serving: OpenAIServing,
    request: Request,
    body: CompletionRequest,
    request_id: str,
    created: int,
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
    echoes: list[str],
    n: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=request_id, created=created, model=serving.model_name, choices=choices, usage=usage
        )

    deltas = _Deltas()
    offsets: dict[tuple[int, int], int] = {}  # each sample's next logprobs text_offset
    events = _sse_events(serving, request, started, body.include_usage, lambda u: chunk([], u))
    async for event in events:
        if isinstance(event, str):
            yield event
            continue
        index, output = event
        # One choice per chunk, as OpenAI streams n > 1.
        for sample in output.outputs:
            key = (index, sample.index)
            taken = deltas.take(key, sample)
            if taken is None:
                continue
            delta, logprobs, finished = taken
            text, entries = delta, _entries(logprobs)
            if key not in offsets:  # the sample's first chunk: the echo goes first
                text = echoes[index] + delta
                if body.echo:
                    entries = _prompt_entries(output) + entries
                offsets[key] = 0
            choice = CompletionChoice(
                index=index * n + sample.index,
                text=text,
                finish_reason=sample.finish_reason if finished else None,
            )
            if sample.logprobs is not None:
                # The new tokens start where the previously sent ones ended.
                choice.logprobs = serving.completion_logprobs(entries, offsets[key], body.logprobs)
                offsets[key] += sum(map(len, choice.logprobs.tokens))
            yield _sse(chunk([choice]).model_dump_json())


async def _chat_stream(
    serving: OpenAIServing,
    request: Request,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
    n: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=request_id, created=created, model=serving.model_name, choices=choices, usage=usage
        )

    # As OpenAI does, open every choice with the role and no content; one choice per chunk.
    for i in range(n):
        opening = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield _sse(chunk([opening]).model_dump_json())
    deltas = _Deltas()
    parsers = [serving.output_parser(body) for _ in range(n)]
    called = [False] * n  # whether the choice has sent a tool call
    events = _sse_events(serving, request, started, body.include_usage, lambda u: chunk([], u))
    async for event in events:
        if isinstance(event, str):
            yield event
            continue
        _, output = event
        for sample in output.outputs:
            taken = deltas.take((0, sample.index), sample)
            if taken is None:
                continue
            text, logprobs, finished = taken
            parser = parsers[sample.index]
            if not parser.active:
                delta, finish_reason = DeltaMessage(content=text), sample.finish_reason
            else:
                piece = parser.feed(text)
                if finished:
                    piece += parser.finish()
                if not (piece.reasoning or piece.content or piece.tool_calls):
                    if not (finished or logprobs):
                        continue  # held back: it may be part of a tag
                called[sample.index] |= bool(piece.tool_calls)
                delta = DeltaMessage(
                    content=piece.content or None,
                    reasoning_content=piece.reasoning or None,
                    tool_calls=[_delta_tool_call(d) for d in piece.tool_calls] or None,
                )
                finish_reason = _chat_finish_reason(
                    sample.finish_reason, called[sample.index] and not parser.broken
                )
            choice = ChatChunkChoice(
                index=sample.index,
                delta=delta,
                logprobs=serving.chat_logprobs(logprobs) if sample.logprobs is not None else None,
                finish_reason=finish_reason if finished else None,
            )
            yield _sse(chunk([choice]).model_dump_json())


async def _responses_stream(
    request: Request,
    serving: OpenAIServing,
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
    writer: ResponseWriter,
    parser: ChatOutputParser,
    finish: Callable[[RequestOutput], list[Event]],
) -> AsyncIterator[str]:
    """The Responses event stream: each event named in its ``event:`` line, as OpenAI sends
    them; a failed step ends it with ``response.failed``."""

    def sse(events: list[Event]) -> str:
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)

    yield sse(writer.start())
    sent = 0
    try:
        async for _, output in serving.merge(request, started):
            sample = output.outputs[0]
            events = writer.feed(parser.feed(sample.text[sent:]))
            sent = len(sample.text)
            if output.finished:
                events += finish(output)
            yield sse(events)
    except ClientDisconnected:
        logger.info("client left a stream; its requests were aborted")
    except (StepError, EngineDeadError) as e:
        yield sse(writer.fail(str(e)))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        invalid = next((err for err in errors if err.get("type") == "json_invalid"), None)
        if invalid is not None:
            return error_response(
                400,
                f"the request body is not valid JSON: {invalid.get('msg')}",
                code="invalid_json",
            )
        params = [_param(err.get("loc", ())) for err in errors]
        message = "; ".join(f"{p}: {err.get('msg')}" for p, err in zip(params, errors))
        return error_response(400, message, param=params[0] if params else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 404:
            message = f"{request.method} {request.url.path} is not a known route"
        return error_response(e.status_code, message)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(EngineUnavailableError)
    async def engine_unavailable(request: Request, e: EngineUnavailableError) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(ControlArgumentError)
    async def control_argument(request: Request, e: ControlArgumentError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(ControlConflictError)
    async def control_conflict(request: Request, e: ControlConflictError) -> JSONResponse:
        return error_response(409, str(e), code="conflict")

    @app.exception_handler(StepError)
    async def step_error(request: Request, e: StepError) -> JSONResponse:
        return error_response(500, str(e))

    @app.exception_handler(BodyTooLargeError)
    async def body_too_large(request: Request, e: BodyTooLargeError) -> JSONResponse:
        return error_response(413, str(e), code="request_too_large")

    @app.exception_handler(UnsupportedMediaTypeError)
    async def not_json(request: Request, e: UnsupportedMediaTypeError) -> JSONResponse:
        return error_response(415, str(e), param="Content-Type", code="unsupported_media_type")

    @app.exception_handler(ClientDisconnect)  # while the body was read
    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(
        request: Request, e: ClientDisconnected | ClientDisconnect
    ) -> Response:
        # A normal event, not a failure: one line, no traceback. Nobody reads the response.
        logger.info(
            "client left %s %s; its requests were aborted", request.method, request.url.path
        )
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets OpenAI's error body.
        return error_response(500, f"internal server error: {e!r}")


# What pydantic puts in an error's location besides field names and indices: the member of a
# union that was tried ("str", "list[constrained-int]", ...).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool"})


def _param(loc: Sequence[str | int]) -> str:
    """The field an error's location names, as OpenAI's ``param`` (``messages.0.role``)."""
    parts = [
        str(part)
        for part in loc
        if part != "body"
        and (isinstance(part, int) or (part.isidentifier() and part not in _TYPE_TAGS))
    ]
    return ".".join(parts)
