"""The OpenAI-compatible HTTP app of an engine's API server process.

`build_app(engine, registry)` wires the routes to an `EngineClient`; the CLI runs it under uvicorn once
the engine is ready. Every error leaves in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`:
400 for bad input (never 422 or 500), 404 for an unknown model, 429 (with `Retry-After`) past
--max-waiting-requests, 503 when the engine is dead or draining.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import prometheus_client
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem_engine.entrypoints.openai_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
)
from tandem_engine.entrypoints.serving_chat import ChatServing, render_chat
from tandem_engine.entrypoints.serving_common import (
    check_model,
    engine_error,
    error_response,
    parse_body,
)
from tandem_engine.entrypoints.serving_completion import CompletionServing
from tandem_engine.frontend.interface import EngineClient, EngineDeadError, EngineOverloadedError, RequestError

logger = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


REVISION_HEADER = "X-Tandem-Revision"


def build_app(engine: EngineClient, registry: prometheus_client.CollectorRegistry,
              kv_events: dict[str, object] | None = None, revision: str = "") -> FastAPI:
    """`kv_events`: what `GET /kv_events` tells routers (EngineConfig.kv_events_info); none: not published.
    `revision`: sent with every /health answer, for routers that pair prefill and decode engines by it."""
    app = FastAPI(title="tandem engine", docs_url=None, redoc_url=None, openapi_url=None)
    completions = CompletionServing(engine)
    chat = ChatServing(engine)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.create(request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        card = ModelCard(id=engine.model_name, root=engine.model_name, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> Response:
        headers = {REVISION_HEADER: revision} if revision else None
        return Response(status_code=200 if engine.is_ready else 503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus_client.generate_latest(registry), media_type=METRICS_CONTENT_TYPE)

    @app.get("/kv_events")
    async def kv_events_info() -> Response:
        return JSONResponse(kv_events or {"block_size": None, "publishers": []})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest)
        check_model(engine, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("Give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            tokens, _ = render_chat(engine, req.messages, req.add_generation_prompt, req.tools, req.tool_choice)
        else:
            tokens = engine.tokenize(req.prompt or "", add_special_tokens=req.add_special_tokens)
        body = TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len)
        return JSONResponse(body.model_dump())

    @app.get("/tokenizer")
    async def tokenizer() -> Response:
        # What a router needs to compute this engine's block hashes (docs/contracts.md, "Block hashing").
        try:
            return Response(engine.tokenizer_spec(), media_type="application/json")
        except TypeError as exc:  # not a fast tokenizer
            raise OpenAIError(str(exc), HTTPStatus.NOT_IMPLEMENTED) from None

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        check_model(engine, req.model)
        try:
            text = engine.detokenize(req.tokens)
        except (ValueError, IndexError, OverflowError, TypeError) as exc:
            raise OpenAIError(f"Cannot detokenize these tokens: {exc}", param="tokens") from None
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    add_error_handlers(app)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> Response:
        return error_response(engine_error(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(engine_error(exc))

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, exc: EngineOverloadedError) -> Response:
        return error_response(engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_failed(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"Invalid request: {first.get('msg', 'validation failed')}"
        return error_response(OpenAIError(message, param=loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        try:
            status = HTTPStatus(exc.status_code)
        except ValueError:
            status = HTTPStatus.INTERNAL_SERVER_ERROR
        return error_response(OpenAIError(str(exc.detail), status))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not bad input. Starlette re-raises after this answer, so the server logs the traceback.
        logger.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
        return error_response(OpenAIError("Internal server error", HTTPStatus.INTERNAL_SERVER_ERROR))
