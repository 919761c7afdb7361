"""`strata serve`'s HTTP layer: an OpenAI-compatible API on FastAPI, over engine/scheduler.py.

FastAPI and pydantic parse every request and serialize every response (the engine writes no JSON
by hand); this module only maps the API's fields to a scheduler Job and its result back. Every
error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and a bad request is a
400 naming the field, never a 500 or a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from .sampling import SamplerParams
from .scheduler import Busy, Closed, Job, Scheduler
from .tokenizer import Tokenizer

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before retrying
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


# --- requests ----------------------------------------------------------------------------------------


class _Sampling(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored (OpenAI clients send extras such as
    `user` or `logprobs: false`); a known field of the wrong type is a 400 naming it."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # the chat API's newer spelling
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM's: -1 or 0 is off
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: StrictInt = Field(1, ge=1, le=1)  # one choice per request in this version
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def sampler_params(self) -> SamplerParams:
        # OpenAI's defaults (temperature 1, top_p 1) and no top-k / min-p / repeat penalty unless asked,
        # as vLLM serves: a client gets the distribution it asks for, not llama.cpp's CLI defaults.
        return SamplerParams(temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
                             min_p=self.min_p, repeat_penalty=1.0, repeat_last_n=0, seed=self.seed)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, param: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):  # the content-parts form: only text parts are understood
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _BadField(f"{param}[{j}]", f"{param}[{j}]: a content part of type {part.get('type')!r}; "
                                "only text parts are served")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt]
    echo: bool = False


def _unicode(text: str, param: str) -> str:
    """`text` if it can be encoded: JSON's \\ud800 escapes decode to lone surrogates, which are no text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _BadField(param, f"{param}: character {e.start} is a lone surrogate ({text[e.start]!r}), not "
                        "Unicode text") from None
    return text


# --- responses -------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# --- errors ----------------------------------------------------------------------------------------


class _BadField(Exception):
    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 503: "server_overloaded", 500: "internal_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _field(loc) -> str | None:
    """pydantic's location ('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "int", "float", "bool", "none") or "[" in p:  # a union's branch (list[int]): not a field
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None


# --- the app ---------------------------------------------------------------------------------------


@dataclass
class Metrics:
    """Counted in the HTTP layer; the scheduler counts tokens and the cache its hits."""

    responses: dict[int, int] = field(default_factory=dict)  # API requests by HTTP status


@dataclass
class ServeConfig:
    model_name: str
    max_context: int
    api_key: str | None = None


def make_app(scheduler: Scheduler, tok: Tokenizer, config: ServeConfig, tier=None) -> FastAPI:
    """The FastAPI app serving `scheduler` (which owns the model); closing the app closes it.
    `tier`: the GPU tier the model runs on, if any (its expert hits go to /metrics)."""
    metrics = Metrics()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # SIGTERM: uvicorn let the in-flight responses finish (up to its graceful timeout) or cancelled
        # them; what is left is cancelled here and the worker stopped, so the process exits cleanly.
        await asyncio.get_running_loop().run_in_executor(None, scheduler.close)

    app = FastAPI(title="strata", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {err.get('msg')} (at {err.get('loc')[-1]})", None,
                          "invalid_json")
        if tuple(err.get("loc", ())) == ("body",) and isinstance(err.get("input"), (bytes, str)):
            # FastAPI reads the body as JSON only under that content type (curl -d sends a form type)
            return _error(400, "the body must be a JSON object sent with the header Content-Type: application/json",
                          None, "invalid_json")
        param = _field(err.get("loc", ()))
        msg = err.get("msg", "invalid")
        found = err.get("input")
        shown = f"; found {found!r}" if found is not None and not isinstance(found, (dict, list)) else ""
        return _error(400, f"{param or 'the body'}: {msg}{shown}", param, "invalid_value")

    @app.exception_handler(_BadField)
    async def _bad(request: Request, e: _BadField):
        return _error(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    class _AuthAndCount:
        """The API key check and the status count, as plain ASGI: Starlette's BaseHTTPMiddleware wraps
        the request's receive channel, and a handler behind it never saw its client disconnect."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            path = scope.get("path", "")
            if scope["type"] != "http" or not path.startswith("/v1/"):
                return await self.inner(scope, receive, send)
            counted = scope["method"] == "POST"

            async def counting_send(message):
                if counted and message["type"] == "http.response.start":
                    code = message["status"]
                    metrics.responses[code] = metrics.responses.get(code, 0) + 1
                await send(message)

            if config.api_key is not None:
                headers = dict(scope.get("headers") or [])
                if headers.get(b"authorization", b"") != f"Bearer {config.api_key}".encode():
                    response = _error(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                                      None, "invalid_api_key")
                    return await response(scope, receive, counting_send)
            await self.inner(scope, receive, counting_send)

    app.add_middleware(_AuthAndCount)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=config.model_name, created=created, max_model_len=config.max_context)])

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return _prometheus(metrics, scheduler, tier)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [{"role": m.role, "content": _unicode(m.text(f"messages[{i}].content"), f"messages[{i}].content")}
                    for i, m in enumerate(body.messages)]
        extra = dict(body.chat_template_kwargs or {})
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception on bad turns is the client's
            raise _BadField("messages", f"the chat template refused the messages: {e}") from None
        ids = tok.encode(text)
        return await _serve(body, ids, "messages", chat=True, request=request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.echo:
            raise _BadField("echo", "echo: returning the prompt with the reply is not supported")
        if isinstance(body.prompt, str):
            ids = tok.encode(_unicode(body.prompt, "prompt"))
        else:
            n_vocab = scheduler.model.geometry.n_vocab
            bad = [i for i, t in enumerate(body.prompt) if not 0 <= t < n_vocab]
            if bad:
                raise _BadField(f"prompt[{bad[0]}]", f"prompt[{bad[0]}]: token id {body.prompt[bad[0]]} outside the "
                                f"vocabulary 0..{n_vocab - 1}")
            ids = list(body.prompt)
        return await _serve(body, ids, "prompt", chat=False, request=request)

    async def _serve(body: _Sampling, ids: list[int], prompt_field: str, chat: bool, request: Request):
        if body.model is not None and body.model != config.model_name:
            raise _BadField("model", f"model {body.model!r}: this server serves {config.model_name!r} "
                            "(GET /v1/models)", 400, "model_not_found")
        ctx = config.max_context
        if not ids:
            raise _BadField(prompt_field, f"{prompt_field}: the prompt is empty (no tokens)")
        if len(ids) >= ctx:
            raise _BadField(prompt_field, f"{prompt_field}: the prompt has {len(ids)} tokens, the context holds {ctx} "
                            "(--ctx-size) and at least one must be left to generate", code="context_length_exceeded")
        limit = body.limit
        if limit is not None and len(ids) + limit > ctx:
            param = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
            raise _BadField(param, f"{param} {limit}: the prompt ({len(ids)} tokens) + {limit} = {len(ids) + limit} "
                            f"tokens do not fit in the context of {ctx} (--ctx-size)", code="context_length_exceeded")
        if any(not s for s in body.stops):
            raise _BadField("stop", "stop: an empty string would stop before the first token")
        try:
            params = body.sampler_params()
        except ValueError as e:
            raise _BadField(None, str(e)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(prompt=ids, max_tokens=limit if limit is not None else ctx - len(ids), params=params,
                  ignore_eos=body.ignore_eos, stops=body.stops,
                  on_text=lambda t: loop.call_soon_threadsafe(events.put_nowait, t),
                  on_done=lambda j: loop.call_soon_threadsafe(events.put_nowait, None))
        try:
            scheduler.submit(job)
        except (Busy, Closed) as e:
            return _error(503, str(e), None, "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            gen = _chat_stream(job, events, rid, config.model_name) if chat else _completion_stream(job, events, rid, config.model_name)
            return StreamingResponse(_cancel_on_exit(gen, job), media_type="text/event-stream")
        try:
            while True:
                try:
                    if await asyncio.wait_for(events.get(), DISCONNECT_POLL_S) is None:
                        break
                except asyncio.TimeoutError:
                    # a non-streaming handler is not cancelled when its client leaves: ask the connection
                    if not job.cancelled and await request.is_disconnected():
                        job.cancel()  # the worker moves on at its next token; on_done still comes
        finally:
            job.cancel()
        if job.error is not None:
            return _error(500, f"the generation failed: {type(job.error).__name__}: {job.error}")
        if job.result is None:
            return _error(503, "the request was cancelled: the server is shutting down", None, "server_shutdown",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
        usage = _usage(job)
        now = int(time.time())
        if chat:
            return ChatCompletion(id=rid, created=now, model=config.model_name, usage=usage, choices=[
                ChatChoice(message=ChatResponseMessage(content=job.text), finish_reason=job.finish)])
        return Completion(id=rid, created=now, model=config.model_name, usage=usage,
                          choices=[CompletionChoice(text=job.text, finish_reason=job.finish)])

    return app


def _usage(job: Job) -> Usage:
    n_out = len(job.result.tokens) if job.result is not None else 0
    return Usage(prompt_tokens=len(job.prompt), completion_tokens=n_out, total_tokens=len(job.prompt) + n_out)


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


async def _cancel_on_exit(gen: AsyncIterator[str], job: Job) -> AsyncIterator[str]:
    """A client that disconnects mid-stream closes this generator: the job is cancelled at once and
    the worker moves on at its next token."""
    try:
        async for item in gen:
            yield item
    finally:
        job.cancel()


async def _chat_stream(job: Job, events: asyncio.Queue, rid: str, model: str) -> AsyncIterator[str]:
    now = int(time.time())
    chunk = lambda delta, finish=None, usage=None: ChatCompletionChunk(  # noqa: E731
        id=rid, created=now, model=model, choices=[ChatChunkChoice(delta=delta, finish_reason=finish)], usage=usage)
    yield _sse(chunk(ChatDelta(role="assistant", content="")))
    while (text := await events.get()) is not None:
        yield _sse(chunk(ChatDelta(content=text)))
    if job.result is not None:
        yield _sse(chunk(ChatDelta(), job.finish or "stop", _usage(job)))
    yield "data: [DONE]\n\n"


async def _completion_stream(job: Job, events: asyncio.Queue, rid: str, model: str) -> AsyncIterator[str]:
    now = int(time.time())
    while (text := await events.get()) is not None:
        yield _sse(Completion(id=rid, created=now, model=model, choices=[CompletionChoice(text=text)]))
    if job.result is not None:
        yield _sse(Completion(id=rid, created=now, model=model, usage=_usage(job),
                              choices=[CompletionChoice(text="", finish_reason=job.finish or "stop")]))
    yield "data: [DONE]\n\n"


def _prometheus(metrics: Metrics, scheduler: Scheduler, tier=None) -> str:
    c, cache = scheduler.counters, scheduler.cache
    lines = []

    def metric(name: str, kind: str, help: str, samples) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            shown = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"{name}{shown} {value}")

    metric("strata_requests_total", "counter", "completion requests answered, by HTTP status",
           [({"code": str(k)}, v) for k, v in sorted(metrics.responses.items())] or [({}, 0)])
    metric("strata_requests_finished_total", "counter", "requests the worker ran to their end (finished, cancelled or failed)",
           [({}, c.requests_done)])
    metric("strata_requests_cancelled_total", "counter", "requests cancelled (client gone, shutdown)", [({}, c.requests_cancelled)])
    metric("strata_requests_rejected_total", "counter", "requests refused with 503: the queue was full", [({}, c.requests_rejected)])
    metric("strata_tokens_generated_total", "counter", "tokens sampled", [({}, c.tokens_generated)])
    metric("strata_prompt_tokens_total", "counter", "prompt tokens of the requests run", [({}, c.prompt_tokens)])
    metric("strata_prompt_tokens_fed_total", "counter", "prompt tokens fed to the model (the rest came from the conversation cache)",
           [({}, c.prompt_tokens_fed)])
    metric("strata_queue_depth", "gauge", "requests waiting for the worker", [({}, scheduler.queue_depth)])
    metric("strata_requests_running", "gauge", "requests the worker is running", [({}, scheduler.running)])
    metric("strata_conversation_cache_hits_total", "counter", "prompts that resumed a parked session", [({}, cache.hits)])
    metric("strata_conversation_cache_misses_total", "counter", "prompts that started cold", [({}, cache.misses)])
    metric("strata_conversation_cache_tokens_saved_total", "counter", "prompt tokens not fed again thanks to the cache",
           [({}, cache.tokens_saved)])
    metric("strata_conversation_cache_sessions", "gauge", "sessions parked now", [({}, len(cache))])
    metric("strata_conversation_cache_bytes", "gauge", "host bytes of the parked sessions", [({}, cache.bytes)])
    sp = scheduler.spec_stats
    if sp is not None:  # --spec: the drafts of every request so far
        pos = lambda a: [({"position": str(i + 1)}, int(v)) for i, v in enumerate(a)]  # noqa: E731
        metric("strata_spec_drafted_total", "counter", "draft tokens made, by position in the chain (1: right after "
               "the last accepted token)", pos(sp.drafted))
        metric("strata_spec_accepted_total", "counter", "draft tokens the trunk kept, by position in the chain",
               pos(sp.accepted))
        metric("strata_spec_verifications_total", "counter", "draft chains verified (one per request and step)",
               [({}, sp.verifications)])
        metric("strata_spec_verified_tokens_total", "counter", "tokens the verifications produced (kept drafts and "
               "the trunk's own token)", [({}, sp.produced)])
        metric("strata_spec_tokens_per_verification", "gauge", "verified tokens / verifications since the start",
               [({}, f"{sp.tokens_per_verification():.6f}" if sp.verifications else "NaN")])
        metric("strata_spec_verify_forwards_total", "counter", "forwards of the trunk that verified drafts (with "
               "--batch-mtp one per step for every request)", [({}, c.verify_forwards)])
    if tier is not None:
        st = tier.stats
        metric("strata_gpu_expert_hits_total", "counter", "routed experts computed from the GPU tier's slots",
               [({}, int(st.hits.sum()))])
        metric("strata_gpu_expert_misses_total", "counter", "routed experts computed on the CPU (not in a slot)",
               [({}, int(st.misses.sum()))])
        metric("strata_gpu_expert_hit_rate", "gauge", "hits / (hits + misses) since the start", [({}, f"{st.hit_rate:.6f}")])
    return "\n".join(lines) + "\n"
