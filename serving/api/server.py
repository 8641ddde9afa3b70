"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, body limits and the error contract.

Error contract: bad input -> 4xx in OpenAI's error format naming the problem (400 invalid request or profiler
misuse, 401 missing/wrong API key, 404 unknown model, route or stored response, 413 body too large, 503 queue
full), in Anthropic's format on `/v1/messages`; the server never answers 500 to bad input. A non-streaming
request whose client disconnects is aborted within a step; a streaming one when its stream is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.chat import chat_completion
from serving.api.completions import completion
from serving.api.context import Context, NotFound
from serving.api.generation import SSE_DONE, now, sse
from serving.api.messages import anthropic_error, count_tokens, create_message
from serving.api.messages_protocol import CountTokensRequest, MessagesRequest
from serving.api.protocol import ChatCompletionRequest, CompletionRequest
from serving.api.response_store import DEFAULT_MAX_BYTES as STORE_MAX_BYTES
from serving.api.response_store import DEFAULT_MAX_ENTRIES as STORE_MAX_ENTRIES
from serving.api.response_store import ResponseStore
from serving.api.responses import create_response, delete_response, stored_response
from serving.api.responses_protocol import ResponsesRequest
from serving.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from serving.engine.async_engine import AsyncEngine, EngineDead
from serving.engine.profiler import Profiler, ProfilerError
from serving.engine.scheduler import QueueFull
from serving.runtime.exe_cache import DEFAULT_CACHE_DIR, DEFAULT_MAX_BYTES
from serving.text.template_kwargs import ChatTemplateKwargs

log = logging.getLogger("serving.api")

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP server and its process (each field is also a server flag, see `serving.engine.args`)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on /v1 routes, /tokenize, "
                "/detokenize, /start_profile and /stop_profile"})
    max_request_body_bytes: int = field(default=32 << 20, metadata={"help": "larger request bodies get HTTP 413"})
    compilation_cache_dir: str = field(default=str(DEFAULT_CACHE_DIR), metadata={
        "help": "where compiled steps are kept: a restart with the same flags loads them ('' turns it off): the "
                "programs themselves (executables/, no tracing either), on one device or a mesh"})
    compilation_cache_max_gb: int = field(default=DEFAULT_MAX_BYTES >> 30, metadata={
        "help": "bound on that cache's size in GiB: the least recently used programs are deleted beyond it (old "
                "source versions and configs); 0: no bound"})
    background_compile: bool = field(default=True, metadata={
        "help": "ready once the largest step bucket of each function and the decode ones are compiled; the others "
                "compile in a background thread, steps padding up meanwhile (on a CPU each waits until the server "
                "idles or padding has cost its compile time); off: compile every bucket before ready"})
    keep_host_memory: bool = field(default=True, metadata={
        "help": "glibc malloc keeps the host memory XLA:CPU steps free (no mmap, no trim) instead of "
                "returning it and faulting it in again each step (8 x 512-token prefill ~13% faster); the process "
                "holds its peak host memory (`serving.runtime.host_memory`)"})
    disable_access_log: bool = field(default=False, metadata={"help": "no log line per HTTP request"})
    log_level: str = field(default="info", metadata={"choices": LOG_LEVELS, "help": "the server's log level"})
    profile_dir: str | None = field(default=None, metadata={
        "help": "enables POST /start_profile and /stop_profile: jax.profiler traces written under this folder "
                "(TensorBoard / XProf / Perfetto)"})
    default_chat_template_kwargs: str | None = field(default=None, metadata={
        "help": "JSON object: what a chat request that states nothing about thinking gets, e.g. "
                "'{\"thinking\": false}' or '{\"reasoning_effort\": \"max\"}' (keys thinking / enable_thinking, "
                "reasoning_effort); replaces the checkpoint's own (tokenizer_config.json's chat_template_kwargs). "
                "Default: the checkpoint's, else V4.1's recipe (thinking on at effort 50)"})
    responses_store_max_entries: int = field(default=STORE_MAX_ENTRIES, metadata={
        "help": "/v1/responses keeps at most this many responses for previous_response_id (least recently used "
                "evicted first)"})
    responses_store_max_bytes: int = field(default=STORE_MAX_BYTES, metadata={
        "help": "and at most this many bytes of them (responses and their conversations, as JSON)"})

    @property
    def compilation_cache_max_bytes(self) -> int | None:
        return self.compilation_cache_max_gb * 2**30 or None

    @property
    def chat_template_defaults(self) -> ChatTemplateKwargs | None:
        """`--default-chat-template-kwargs`, parsed; None when not given."""
        if self.default_chat_template_kwargs is None:
            return None
        return ChatTemplateKwargs.parse_json(self.default_chat_template_kwargs, "default_chat_template_kwargs")

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.compilation_cache_max_gb < 0:
            raise ValueError(f"compilation_cache_max_gb must be >= 0 (0: no bound), got "
                             f"{self.compilation_cache_max_gb}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.profile_dir is not None and (not self.profile_dir or Path(self.profile_dir).is_file()):
            raise ValueError(f"profile_dir must name a folder, got {self.profile_dir!r}")
        self.chat_template_defaults  # noqa: B018 - raises naming the field when it is not a valid object
        for name in ("responses_store_max_entries", "responses_store_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLarge",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


def error_for(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    """The error in the format of the API `path` belongs to: Anthropic's on its routes, else OpenAI's."""
    return anthropic_error(status, message) if path in ANTHROPIC_ROUTES else error(status, message, param)


# pydantic names the member of a union it tried in the error's location ("str", "list[TextPart]", "literal[...]",
# a model's class name); the client's field path leaves them out
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|(list|dict|literal|tagged-union|function-\w+)\[.*\]|[A-Z]\w*)$")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = []
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        path = [x for x in loc if not _UNION_MEMBER.match(x)]
        # "not a string" from the string member of `str | list[...]` says nothing when the list member says more
        mismatch = len(path) < len(loc) and str(e.get("type", "")).endswith("_type")
        errors.append((e, path, mismatch))
    if not all(mismatch for _, _, mismatch in errors):
        errors = [x for x in errors if not x[2]]
    parts, param = [], None
    for e, loc, _ in errors:
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('msg')}")
            continue
        where = ".".join(loc) or "body"
        param = param or where
        shown = "input" in e and loc and e.get("type") != "missing"  # a missing field's input is its parent
        parts.append(f"{where}: {e.get('msg')}" + (f" (got {e['input']!r})" if shown else ""))
    return "; ".join(parts) or "invalid request", param


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_at(body: bytes) -> str | None:
    """Where a JSON body holds a lone UTF-16 surrogate (a `\\ud800` escape with no partner): JSON carries it, no
    tokenizer or UTF-8 reply can, and every string field of every route would otherwise have to guard itself.
    None when there is none (a regex over the bytes; the body is parsed only when an escape appears)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None  # the route's own parser names the bad JSON

    def walk(x, path):
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(x, dict):
            for k, v in x.items():
                found = walk(k, f"{path}.{ascii(k)}" if path else ascii(k)) or walk(v, f"{path}.{k}" if path else k)
                if found:
                    return found
        elif isinstance(x, list):
            for i, v in enumerate(x):
                if found := walk(v, f"{path}.{i}" if path else str(i)):
                    return found
        return None

    return walk(doc, "")


PROFILE_ROUTES = ("/start_profile", "/stop_profile")
GUARDED_ROUTES = PROFILE_ROUTES + ("/tokenize", "/detokenize")  # beside every /v1 route


class Gate:
    """ASGI middleware in front of every route: the API key on /v1, tokenizer and profiler routes (401; as
    `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`), and request bodies over `limit` bytes refused
    (413), by header or while streaming in, and bodies holding a lone surrogate (400, naming the field). Pure ASGI,
    so streaming and disconnects pass through."""

    def __init__(self, app, limit: int, api_key: str | None):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, path = dict(scope.get("headers") or []), scope["path"]
        if self.api_key is not None and (path.startswith("/v1") or path in GUARDED_ROUTES):
            if (headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode()
                    and headers.get(b"x-api-key", b"") != self.api_key.encode()):
                return await error_for(path, 401, "missing or wrong API key (send 'Authorization: Bearer <key>' "
                                                  "or 'x-api-key: <key>')")(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await error_for(path, 413, f"request body of {int(declared)} bytes exceeds the limit of "
                                              f"{self.limit}")(scope, receive, send)
        pending, total, more = [], 0, True
        while more:  # read the body up front (FastAPI would anyway) so an oversize one never reaches the app
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left
            total += len(msg.get("body", b""))
            if total > self.limit:
                return await error_for(path, 413, f"request body exceeds the limit of {self.limit} bytes")(
                    scope, receive, send)
            pending.append(msg)
            more = msg.get("more_body", False)
        if (where := lone_surrogate_at(b"".join(m.get("body", b"") for m in pending))) is not None:
            return await error_for(path, 400, f"{where}: not valid Unicode text (it holds a lone surrogate, such "
                                              f"as a \\ud800 escape with no partner)", where)(scope, receive, send)

        async def replay():
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)


def build_app(engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, api_key: str | None = None,
              max_body_bytes: int = 32 << 20, profile_dir: str | None = None,
              chat_defaults: ChatTemplateKwargs | None = None, response_store: ResponseStore | None = None) -> FastAPI:
    """`chat_defaults`: what a chat request that states nothing about thinking gets (None: V4.1's recipe)."""
    app = FastAPI(title="dsv41-jax", docs_url=None, redoc_url=None)
    app.add_middleware(Gate, limit=max_body_bytes, api_key=api_key)
    ctx = Context(engine, tokenizer, model_name, chat_defaults or ChatTemplateKwargs(), max_model_len,
                  ResponseStore() if response_store is None else response_store)
    metrics = engine.engine.metrics
    profiler = app.state.profiler = Profiler(profile_dir)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_for(request.url.path, 400, msg, param)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound):  # a stored response that is not (or no longer) kept
        return error_for(request.url.path, 404, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_for(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # a bug: say so, keep serving
        log.exception("internal error")
        return error_for(request.url.path, 500, f"internal error: {exc!r}")

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return error(503, f"the engine stopped: {engine.error!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "dsv41-jax", "root": model_name,
                                            "max_model_len": max_model_len}]}

    # vLLM's routes. Starting and stopping block (the stop writes the files), hence the worker thread; the
    # engine thread keeps stepping meanwhile, so the trace holds whatever the engine ran in between.
    @app.post("/start_profile")
    async def start_profile():
        try:
            folder = await asyncio.to_thread(profiler.start)
        except ProfilerError as e:
            return error(400, str(e))
        log.info("profiling into %s", folder)
        return {"status": "profiling", "trace_dir": str(folder)}

    @app.post("/stop_profile")
    async def stop_profile():
        try:
            trace = await asyncio.to_thread(profiler.stop)
        except ProfilerError as e:
            return error(400, str(e))
        log.info("trace written to %s", trace.folder)
        return {"status": "stopped", **trace.describe()}

    async def run(request: Request, body, handler):
        def fail(status: int, message: str, param: str | None = None) -> JSONResponse:
            return error_for(request.url.path, status, message, param)

        if body.model is not None and body.model != model_name:
            return fail(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model")
        if ignored := body.ignored_fields():
            log.warning("ignoring unknown request fields %s", ignored)
        if msg := body.unsupported():
            return fail(400, msg, msg.split(":")[0])
        session = request.headers.get("x-session-id")
        try:
            result = await handler(body, ctx, session)
        except ValueError as e:
            return fail(400, str(e))
        except QueueFull as e:
            return fail(503, f"{e}; retry later")
        except EngineDead as e:
            return fail(503, str(e))
        if isinstance(result, dict):
            return result
        return StreamingResponse(_guard(result, request), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest):
        return await _until_disconnect(request, run(request, body, chat_completion))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await _until_disconnect(request, run(request, body, completion))

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest):
        return await _until_disconnect(request, run(request, body, create_response))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return stored_response(ctx, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str):
        return delete_response(ctx, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request, body: MessagesRequest):
        return await _until_disconnect(request, run(request, body, create_message))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request, body: CountTokensRequest):
        return await run(request, body, count_tokens)

    @app.post("/tokenize")
    async def tokenize_route(request: Request, body: TokenizeRequest):
        return await run(request, body, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request, body: DetokenizeRequest):
        return await run(request, body, detokenize)

    return app


async def _guard(lines: AsyncIterator[str], request: Request) -> AsyncIterator[str]:
    """Stream SSE lines until done or the client leaves (then the producer is cancelled: its requests abort).
    Uvicorn does not fail a write to a closed connection, and a stream may go quiet while tokens complete no
    character, so the connection is watched rather than waiting for a failed send. An engine failure
    mid-stream becomes an SSE error event instead of a broken connection."""
    gone = asyncio.ensure_future(_disconnected(request))
    it, nxt = lines.__aiter__(), None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait([nxt, gone], return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                log.info("client disconnected; streaming request aborted")
                return
            try:
                line = nxt.result()
            except StopAsyncIteration:
                return
            except EngineDead as e:
                yield sse({"error": {"message": str(e), "type": "ServiceUnavailableError", "code": 503}})
                yield SSE_DONE
                return
            yield line
    finally:
        gone.cancel()
        # Starlette may cancel this generator (its own disconnect watch) at any await, and its cancel scope
        # re-raises at every later await here: the producer is shut down from a task of its own.
        _background.add(t := asyncio.ensure_future(_shutdown(nxt, lines)))
        t.add_done_callback(_background.discard)


_background: set[asyncio.Future] = set()


async def _shutdown(nxt: asyncio.Future | None, lines) -> None:
    """Cancel a pending `__anext__` (unwinding the producer closes its streams: the requests abort), else
    close the producer."""
    if nxt is not None and not nxt.done():
        nxt.cancel()
        await asyncio.gather(nxt, return_exceptions=True)
    else:
        await lines.aclose()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _until_disconnect(request: Request, work):
    """Run a handler; if the client goes away first, cancel it (its streams close and abort)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        log.info("client disconnected; request aborted")
        return Response(status_code=499)
    return task.result()
