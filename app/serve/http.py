"""The HTTP side of `carve serve`: starlette routes for the OpenAI endpoints, run by uvicorn.

    GET  /v1/models               the one loaded model (id: its file name without .gguf)
    POST /v1/chat/completions     messages rendered with the model's own chat template
    POST /v1/completions          a raw prompt
    streaming: `data: {chunk}` lines, then `data: [DONE]`

Errors are OpenAI's JSON shape with the status a client expects; none of them stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from app.serve.engine_turns import EngineGone, EngineTurns, Turn
from app.serve.openai_api import (
    ApiError,
    Job,
    Reply,
    bad,
    model_card,
    models_list,
    parse_job,
)
from app.serve.stop_text import StopText
from engine.process import protocol as p
from spec.errors import CarveError

MAX_BODY = 8 << 20  # bytes of request JSON; a full 128K-token context is well under it
POLL = 0.25  # seconds between checks that a client still waiting for its turn is there
LOOPBACK = ("127.0.0.1", "localhost", "::1")
UNBOUNDED = 1 << 30  # max_tokens when a request sets none
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}  # done.reason -> OpenAI's


def _finish(stop: StopText, done: p.Done) -> str:
    # a stop string ended the text: "stop", whatever the engine's Done says (it may have reached
    # max_tokens before the stop request reached it)
    return "stop" if stop.stopped else FINISH.get(done.reason, "stop")


def _completion_tokens(stop: StopText, done: p.Done) -> int:
    # the tokens up to the stop string, not the ones the engine made before it heard the stop
    return min(stop.tokens, done.completion_tokens) if stop.stopped else done.completion_tokens


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def _error(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _engine_error(event: p.Error, job: Job) -> ApiError:
    if event.fatal:
        return ApiError(503, f"the engine stopped: {event.message}", code="engine_stopped",
                        type="server_error")  # fmt: skip
    if event.code == p.CONTEXT_OVERFLOW:
        param = ("max_tokens" if job.max_tokens is not None and "max_tokens" in event.message
                 else "messages" if job.chat else "prompt")  # fmt: skip
        return bad(event.message, param, "context_length_exceeded")
    if event.message.startswith("internal error"):
        return ApiError(500, event.message, type="server_error")
    return bad(event.message)


def _gone(err: EngineGone) -> ApiError:
    return ApiError(503, f"no engine to answer: {err}", code="engine_unavailable",
                    type="server_error")  # fmt: skip


def _sse(obj: dict[str, Any] | str) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class _Guard:
    """Pure ASGI middleware: the bearer key (401) and the body bound announced up front (413)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = None
        if self.api_key is not None:
            given = headers.get("authorization", "")
            scheme, _, key = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), self.api_key.encode()
            ):
                what = "no API key" if not given else "a wrong API key"
                error = ApiError(401, f"the request has {what}; send the header "
                                 "'Authorization: Bearer KEY' with the key carve serve was "
                                 "started with", code="invalid_api_key")  # fmt: skip
        length = headers.get("content-length", "")
        if error is None and length.isdigit() and int(length) > self.max_body:
            error = _too_large(self.max_body)
        if error is not None:
            await _error(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _too_large(max_body: int) -> ApiError:
    return ApiError(413, f"the request body is over {max_body >> 20} MiB; send a shorter one",
                    code="request_too_large")  # fmt: skip


class Api:
    """The routes, over one EngineTurns and the model it serves."""

    def __init__(self, turns: EngineTurns, model: str, max_body: int = MAX_BODY) -> None:
        self.turns, self.model, self.max_body = turns, model, max_body
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_list(self.model, self.created))

    async def model_info(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves "
                           f"{self.model!r}", "model", "model_not_found")  # fmt: skip
        return JSONResponse(model_card(self.model, self.created))

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _json(self, request: Request) -> Any:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:  # a body sent without a length: count as it comes
                raise _too_large(self.max_body)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as err:
            raise bad(f"the request body is not valid JSON: {err}") from None

    async def _complete(self, request: Request, chat: bool) -> Response:
        job = parse_job(await self._json(request), self.model, chat)
        # no max_tokens: up to the end of the context (OpenAI's rule); the engine shortens it
        generate = p.Generate(messages=job.messages, sampling=job.sampling, prompt=job.prompt,
                              max_tokens=job.max_tokens or UNBOUNDED,
                              exact_max_tokens=job.max_tokens is not None)  # fmt: skip
        try:
            turn = await self.turns.begin(generate)
        except EngineGone as err:
            raise _gone(err) from None
        try:
            first = await self._first_event(turn, request)
        except EngineGone as err:
            raise _gone(err) from None
        except BaseException:
            self.turns.abandon(turn)
            raise
        if first is None:  # the client left while it waited
            return Response(status_code=499)
        if isinstance(first, p.Error):
            raise _engine_error(first, job)
        reply = Reply(job, self.model)
        if job.stream:
            return StreamingResponse(self._stream(turn, first, job, reply),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await self._whole(turn, first, job, reply, request)

    async def _first_event(self, turn: Turn, request: Request) -> p.Event | None:
        """The first token, done or error of `turn`; None (turn abandoned) if the client left."""
        while True:
            event = await turn.next_event(POLL)
            if isinstance(event, (p.Token, p.Done, p.Error)):
                return event
            if event is None and await request.is_disconnected():
                self.turns.abandon(turn)
                return None

    async def _whole(self, turn: Turn, event: p.Event, job: Job, reply: Reply,
                     request: Request) -> Response:  # fmt: skip
        stop, parts = StopText(job.stop), []
        checked = time.monotonic()
        try:
            while not isinstance(event, p.Done):
                if isinstance(event, p.Error):
                    raise _engine_error(event, job)
                if isinstance(event, p.Token):
                    parts.append(stop.push(event.text))
                    if stop.stopped:
                        self.turns.stop(turn)
                event = await turn.next_event(POLL)
                if time.monotonic() - checked >= POLL:  # tokens may come faster than POLL
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        self.turns.abandon(turn)
                        return Response(status_code=499)
        except EngineGone as err:
            raise _gone(err) from None
        except BaseException:  # cancelled (the server is stopping) or our own bug
            self.turns.abandon(turn)
            raise
        parts.append(stop.flush())
        usage = Reply.usage(event.prompt_tokens, _completion_tokens(stop, event))
        return JSONResponse(reply.whole("".join(parts), _finish(stop, event), usage))

    async def _stream(self, turn: Turn, event: p.Event, job: Job,
                      reply: Reply) -> AsyncIterator[bytes]:  # fmt: skip
        stop, ended = StopText(job.stop), False
        try:
            if job.chat:
                yield _sse(reply.chunk("", first=True))
            while True:
                if isinstance(event, p.Token):
                    text = stop.push(event.text)
                    if text:
                        yield _sse(reply.chunk(text))
                    if stop.stopped:
                        self.turns.stop(turn)
                elif isinstance(event, p.Done):
                    tail = stop.flush()
                    if tail:
                        yield _sse(reply.chunk(tail))
                    yield _sse(reply.chunk(None, _finish(stop, event)))
                    if job.include_usage:
                        usage = Reply.usage(event.prompt_tokens, _completion_tokens(stop, event))
                        yield _sse(reply.usage_chunk(usage))
                    break
                elif isinstance(event, p.Error):
                    yield _sse(_engine_error(event, job).body())  # headers are gone: say it inline
                    break
                try:
                    event = await turn.next_event()
                except EngineGone as err:
                    yield _sse(_gone(err).body())
                    break
            ended = True
            yield _sse("[DONE]")
        finally:
            if not ended:  # the client went away mid-stream (or the server is shutting down)
                self.turns.abandon(turn)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, f"no route {request.method} {request.url.path}; this server answers "
                       "GET /v1/models, POST /v1/chat/completions and POST /v1/completions",
                       code="unknown_url")  # fmt: skip
    else:
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return _error(err)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error(exc)


async def _internal_error(request: Request, exc: Exception) -> Response:
    text = " ".join(str(exc).split())[:300]
    return _error(ApiError(500, f"internal error: {type(exc).__name__}: {text}",
                           type="server_error"))  # fmt: skip


def build_app(turns: EngineTurns, model: str, api_key: str | None = None,
              max_body: int = MAX_BODY) -> ASGIApp:  # fmt: skip
    """The ASGI app serving `model` through `turns` (bound to the loop it starts on)."""
    api = Api(turns, model, max_body)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        turns.bind(asyncio.get_running_loop())
        yield

    app = Starlette(
        routes=[
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/{model:path}", api.model_info, methods=["GET"]),
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error, ApiError: _api_error,
                            Exception: _internal_error},
        lifespan=lifespan,
    )
    return _Guard(app, api_key, max_body)


class HttpServer:
    """uvicorn on a socket bound here, so a taken port is one clear error before anything runs.
    ``run`` blocks (in the main thread it ends on Ctrl-C/SIGTERM); ``stop`` ends it from any
    thread."""

    def __init__(self, app: ASGIApp, host: str, port: int, verbose: bool = False,
                 on_exit: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="info" if verbose else "warning", ws="none",
                                lifespan="on", timeout_graceful_shutdown=2)  # fmt: skip
        self.server = _Uvicorn(config, on_exit)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def stop(self) -> None:
        self.server.on_exit()
        self.server.should_exit = True


class _Uvicorn(uvicorn.Server):
    """uvicorn that tells the app it is stopping as soon as it is asked to (Ctrl-C, SIGTERM,
    stop()), so requests still waiting on the engine are answered (503) before the graceful
    shutdown's deadline, instead of being cancelled with a traceback in the log."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise CarveError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise CarveError(f"cannot listen on {host}:{port} ({err.strerror}); pick another --port "
                         "or stop what holds it") from None  # fmt: skip
    sock.set_inheritable(True)
    return sock
