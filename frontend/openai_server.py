"""``specdec-openai``: the OpenAI-compatible HTTP API (FastAPI + uvicorn) in
front of the coordinator's gRPC port.

A thin adapter: ``frontend.requests`` maps the request, ``frontend.responses``
builds what goes back, ``frontend.coordinator_client`` streams from Triton.
A streamed request sends each coordinator response as an SSE chunk as it
arrives; a client that goes away cancels its gRPC stream, so the coordinator
stops generating for nobody.

With an API key (``SPECDEC_API_KEY`` in its environment, never a flag) every
endpoint but ``/health`` answers only requests that carry it as OpenAI
clients send it, ``Authorization: Bearer <key>`` (401 otherwise), and the
frontend passes the key on to Triton, whose inference API needs it too."""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from coordinator.request.access import API_KEY_VAR, api_key_from_env
from coordinator.settings import CoordinatorSettings
from frontend import errors, requests, responses
from frontend.coordinator_client import CoordinatorClient, CoordinatorFailure, Piece
from frontend.prompts import Prompts

# The coordinator's own default (coordinator/settings.py): sent explicitly, so
# finish_reason "length" can be told from "stop" for a request without max_tokens.
DEFAULT_MAX_TOKENS = next(f.default for f in fields(CoordinatorSettings) if f.name == "default_max_tokens")


@dataclass
class Settings:
    grpc_url: str = "127.0.0.1:8001"
    model: str = requests.MODEL
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    # The key clients must send (Authorization: Bearer), also sent on to Triton;
    # None: no key asked for. Never in repr: settings may be logged.
    api_key: str | None = field(default=None, repr=False)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


OPEN_PATHS = frozenset({"/health"})  # answered without the API key (probes, specdec-serve's readiness wait)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def key_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response times do not leak the key."""
    return given is not None and hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def create_app(settings: Settings, prompts: Prompts,
               connect: Callable[[str], Any] | None = None) -> FastAPI:
    """The app; ``connect(url)`` makes the coordinator client once the event loop runs
    (default: a gRPC CoordinatorClient that sends ``settings.api_key`` to Triton)."""
    created = int(time.time())
    connect = connect or functools.partial(CoordinatorClient, api_key=settings.api_key)

    async def authorized(request: Request) -> None:
        if settings.api_key is None or request.url.path in OPEN_PATHS:
            return
        token = bearer_token(request.headers.get("authorization"))
        if token is None:
            raise errors.unauthorized("this server needs an API key: send it as the header "
                                      "'Authorization: Bearer <key>' (the openai package's api_key)")
        if not key_matches(token, settings.api_key):
            raise errors.unauthorized("the API key sent in 'Authorization: Bearer' is not this server's")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.coordinator = connect(settings.grpc_url)
        try:
            yield
        finally:
            await app.state.coordinator.close()

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  dependencies=[Depends(authorized)])

    @app.exception_handler(errors.OpenAIError)
    async def openai_error(_request: Request, error: errors.OpenAIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not content_type.startswith("application/json"):
            return await openai_error(request, errors.OpenAIError(
                f"send the request body as JSON with Content-Type: application/json (got {content_type or 'none'!r})"))
        return await openai_error(request, errors.from_validation(error.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(errors.OpenAIError(str(error.detail), status=error.status_code, type=kind).body(),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, error: Exception):
        return JSONResponse(errors.server_error(f"internal error: {error}").body(), status_code=500)

    @app.get("/health")
    async def health(request: Request):
        """200 when the coordinator answers ready through Triton, else 503."""
        if await request.app.state.coordinator.ready():
            return {"status": "ready"}
        failure = errors.OpenAIError(f"the coordinator at {settings.grpc_url} is not ready", status=503,
                                     type="server_error")
        return JSONResponse(failure.body(), status_code=503)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [responses.model_card(settings.model, created)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model != settings.model:
            raise errors.model_not_found(model, settings.model)
        return responses.model_card(settings.model, created)

    @app.post("/v1/completions")
    async def completions(request: Request, body: dict[str, Any] = Body(...)):
        generation = requests.completion_request(body, settings.default_max_tokens, settings.model)
        return await _answer(request, generation)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: dict[str, Any] = Body(...)):
        generation = requests.chat_request(body, settings.default_max_tokens, settings.model)
        return await _answer(request, generation.with_prompt(prompts.chat(generation.messages)))

    async def _answer(request: Request, generation: requests.Generation) -> Response:
        reply = responses.Reply(generation.chat, settings.model, generation.max_tokens, generation.include_usage)
        pieces = request.app.state.coordinator.generate(generation.coordinator_inputs())
        try:
            if not generation.stream:
                async with aclosing(pieces):
                    text, statistics = await _unless_disconnected(request, _collect(pieces))
                return JSONResponse(reply.body(text, statistics, prompts.count(generation.prompt)))
            # The first response decides the status: a refused request is an HTTP error, not a stream.
            first = await _unless_disconnected(request, anext(pieces))
        except CoordinatorFailure as failure:
            await pieces.aclose()
            raise _error(failure, generation) from None
        except ClientGone:
            await pieces.aclose()
            return Response(status_code=499)
        return StreamingResponse(_events(reply, generation, first, pieces), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(reply: responses.Reply, generation: requests.Generation, piece: Piece,
                      pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
        try:
            while True:
                prompt_tokens = prompts.count(generation.prompt) if piece.final and reply.include_usage else None
                for chunk in reply.chunks(piece.text, piece.statistics, prompt_tokens):
                    yield responses.sse(chunk)
                if piece.final:
                    break
                piece = await anext(pieces)
            yield responses.DONE
        except CoordinatorFailure as failure:  # after the stream started: an error event, as OpenAI sends it
            yield responses.sse(_error(failure, generation).body())
            yield responses.DONE
        finally:
            await pieces.aclose()  # cancels the gRPC stream unless it finished

    return app


def _error(failure: CoordinatorFailure, generation: requests.Generation) -> errors.OpenAIError:
    if failure.transport:
        return errors.server_error(failure.message)
    return errors.from_coordinator(failure.message, generation.fields)


async def _collect(pieces: AsyncIterator[Piece]):
    text = []
    async for piece in pieces:
        text.append(piece.text)
        if piece.final:
            return "".join(text), piece.statistics
    raise CoordinatorFailure("the coordinator's stream ended without a final response", transport=True)


async def _unless_disconnected(request: Request, work: Awaitable):
    """``work``'s result, or ClientGone (and ``work`` cancelled) if the client
    disconnects first: uvicorn keeps running a handler whose client left."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def default_tokenizer_dir() -> Path:
    """The target model's directory, found as specdec-serve finds it (the
    built-in pair under the cache, or SPECDEC_TARGET)."""
    try:
        from launcher import assets
    except ImportError:
        raise SystemExit("specdec-openai: give --tokenizer-dir (the target model's tokenizer directory)") from None
    return assets.prepare_model(os.environ.get("SPECDEC_TARGET", assets.DEFAULT_TARGET), assets.default_cache_dir(),
                                "target")


async def wait_for_coordinator(url: str, timeout: float) -> bool:
    client = CoordinatorClient(url)
    deadline = time.monotonic() + timeout
    try:
        while not await client.ready():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(1.0)
        return True
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="specdec-openai", description="OpenAI-compatible API for the coordinator.",
        epilog=f"{API_KEY_VAR} (environment only): the API key clients must send as 'Authorization: Bearer <key>', "
               "also sent on to Triton's inference API; unset: no key is asked for.")
    parser.add_argument("--host", default=env.get("SPECDEC_ADDRESS", "127.0.0.1"),
                        help="address to listen on [SPECDEC_ADDRESS, 127.0.0.1]")
    parser.add_argument("--port", type=int, default=int(env.get("SPECDEC_OPENAI_PORT", 9000)),
                        help="port to listen on [SPECDEC_OPENAI_PORT, 9000]")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton's gRPC address (default 127.0.0.1:8001)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="the target model's tokenizer directory: tokenizer.json and the chat template "
                             "(default: the target specdec-serve prepares)")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"max_tokens of a request without one (default {DEFAULT_MAX_TOKENS}, the coordinator's)")
    parser.add_argument("--wait-for-server", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the coordinator to be ready before listening (default 0)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    api_key = api_key_from_env()
    if args.wait_for_server > 0 and not asyncio.run(wait_for_coordinator(args.grpc_url, args.wait_for_server)):
        print(f"specdec-openai: the coordinator at {args.grpc_url} was not ready within {args.wait_for_server:g} s",
              file=sys.stderr)
        return 1
    prompts = Prompts(args.tokenizer_dir or default_tokenizer_dir())
    app = create_app(Settings(grpc_url=args.grpc_url, default_max_tokens=args.default_max_tokens, api_key=api_key),
                     prompts)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
