"""The OpenAI-compatible HTTP API over an :class:`EngineCoreClient`."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import fields
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from heron import __version__
from heron.engine.core_client import EngineCoreClient, EngineDeadError, StepError
from heron.engine.request import Logprob
from heron.llm import LLM
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import SamplingParams
from heron.server.metrics import ServerMetrics
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
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
)

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
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


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests are aborted."""


def _error_response(
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
    first_word = str(e).split(" ", 1)[0]
    return APIError(400, str(e), param=first_word if first_word in _SAMPLING_FIELDS else None)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """State and request handling shared by the endpoints of one app."""

    # The offline API's template handling only needs ``self.tokenizer``; reuse it as is.
    apply_chat_template = LLM.apply_chat_template

    def __init__(self, engine: EngineCoreClient, served_model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(lambda: engine.stats)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                400,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # ---------------------------------------------------------------- generation

    async def start(
        self, request_id: str, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """Add every prompt and wait for its first output, so invalid prompts fail before any
        response is sent. Returns each prompt's first output and the rest of its stream."""
        streams = [
            self.metrics.track(self.engine.generate(f"{request_id}-{i}", prompt, params))
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
            await _wait_for_disconnect(request)
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

    def completion_logprobs(self, logprobs: list[Logprob], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for lp in logprobs:
            token = self._token(lp.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(lp.logprob)
            result.top_logprobs.append({self._token(t): v for t, v in lp.top.items()})
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
    engine: EngineCoreClient, served_model_name: str, api_key: str | None = None
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``served_model_name``; ``api_key`` guards /v1."""
    serving = OpenAIServing(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Joining the engine core blocks; keep the loop free to deliver the final outputs.
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Heron", version=__version__, lifespan=lifespan)
    app.state.serving = serving
    _add_error_handlers(app)
    api = APIRouter(dependencies=[Depends(_api_key_checker(api_key))])

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return _error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @api.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=served_model_name,
            root=engine.model_path,
            max_model_len=serving.max_model_len,
        )
        return ModelList(data=[card])

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if body.messages is not None:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
            tokens = serving.apply_chat_template(conversation, body.add_generation_prompt)
        elif body.prompt is not None:
            tokens = serving.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len
        )

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        try:
            params = body.sampling_params()
        except ValueError as e:
            raise _bad_value(e) from e
        request_id = f"cmpl-{uuid.uuid4().hex}"
        started = await serving.start(request_id, body.prompts(), params)
        created = int(time.time())
        echoes = [
            (first.prompt or serving.tokenizer.decode(first.prompt_token_ids)) if body.echo else ""
            for first, _ in started
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
                    logprobs = serving.completion_logprobs(sample.logprobs, len(echoes[i]))
                choices.append(
                    CompletionChoice(
                        index=i * params.n + sample.index,
                        text=echoes[i] + sample.text,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                    )
                )
        return JSONResponse(
            CompletionResponse(
                id=request_id,
                created=created,
                model=served_model_name,
                choices=choices,
                usage=serving.usage(finals),
            ).model_dump()
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        try:
            params = body.sampling_params()
            prompt = serving.apply_chat_template(body.conversation(), body.add_generation_prompt)
        except ValueError as e:
            raise _bad_value(e) from e
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        started = await serving.start(request_id, [prompt], params)
        created = int(time.time())
        if body.stream:
            return _streaming(
                _chat_stream(serving, request, body, request_id, created, started, params.n)
            )
        (output,) = await _final_outputs(serving, request, started)
        choices = [
            ChatChoice(
                index=sample.index,
                message=AssistantMessage(content=sample.text),
                logprobs=serving.chat_logprobs(sample.logprobs)
                if sample.logprobs is not None
                else None,
                finish_reason=sample.finish_reason,
            )
            for sample in output.outputs
        ]
        return JSONResponse(
            ChatCompletionResponse(
                id=request_id,
                created=created,
                model=served_model_name,
                choices=choices,
                usage=serving.usage([output]),
            ).model_dump()
        )

    app.include_router(api)
    return app


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
    except ClientDisconnected:
        return
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
    sent_chars: dict[tuple[int, int], int] = {}  # for logprobs' text_offset
    events = _sse_events(serving, request, started, body.include_usage, lambda u: chunk([], u))
    async for event in events:
        if isinstance(event, str):
            yield event
            continue
        index, output = event
        choices = []
        for sample in output.outputs:
            key = (index, sample.index)
            taken = deltas.take(key, sample)
            if taken is None:
                continue
            delta, logprobs, finished = taken
            text = delta
            if key not in sent_chars:
                text = echoes[index] + delta
                sent_chars[key] = len(echoes[index])
            # The new tokens start where the previously sent text (and any echo) ended.
            offset = sent_chars[key]
            sent_chars[key] += len(delta)
            choices.append(
                CompletionChoice(
                    index=index * n + sample.index,
                    text=text,
                    logprobs=serving.completion_logprobs(logprobs, offset)
                    if sample.logprobs is not None
                    else None,
                    finish_reason=sample.finish_reason if finished else None,
                )
            )
        if choices:
            yield _sse(chunk(choices).model_dump_json())


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

    # As OpenAI does, open every choice with the role and no content.
    opening = [
        ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)
    ]
    yield _sse(chunk(opening).model_dump_json())
    deltas = _Deltas()
    events = _sse_events(serving, request, started, body.include_usage, lambda u: chunk([], u))
    async for event in events:
        if isinstance(event, str):
            yield event
            continue
        _, output = event
        choices = []
        for sample in output.outputs:
            taken = deltas.take((0, sample.index), sample)
            if taken is None:
                continue
            text, logprobs, finished = taken
            choices.append(
                ChatChunkChoice(
                    index=sample.index,
                    delta=DeltaMessage(content=text),
                    logprobs=serving.chat_logprobs(logprobs)
                    if sample.logprobs is not None
                    else None,
                    finish_reason=sample.finish_reason if finished else None,
                )
            )
        if choices:
            yield _sse(chunk(choices).model_dump_json())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error_response(400, "the request body is not valid JSON", code="invalid_json")
        first = errors[0] if errors else {}
        # loc is ("body", field, ...): name the field, as OpenAI's param does.
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: {err.get('msg')}"
            for err in errors
        )
        return _error_response(400, message, param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 404:
            message = f"{request.method} {request.url.path} is not a known route"
        return _error_response(e.status_code, message)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return _error_response(503, str(e))

    @app.exception_handler(StepError)
    async def step_error(request: Request, e: StepError) -> JSONResponse:
        return _error_response(500, str(e))
