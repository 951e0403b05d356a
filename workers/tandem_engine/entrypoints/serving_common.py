"""What /v1/completions and /v1/chat/completions share: OpenAI-shaped error responses, request parsing
and length checks, the fan-out of one HTTP request into n engine requests, disconnect detection and SSE
framing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Send

from tandem_engine.entrypoints.openai_protocol import (
    ErrorInfo,
    ErrorResponse,
    OpenAIError,
    PromptTokensDetails,
    UsageInfo,
)
from tandem_engine.frontend.interface import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    RequestError,
    RequestOutput,
)
from tandem_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

# Status for a request whose client left before the answer (nginx's convention; nobody reads it).
CLIENT_CLOSED = 499

# Cleanup tasks that must outlive a cancelled request handler; held here so they are not collected.
_background: set[asyncio.Task[None]] = set()


# ---------------------------------------------------------------------------------------------- errors


def error_body(exc: OpenAIError) -> ErrorResponse:
    info = ErrorInfo(message=exc.message, type=exc.err_type, param=exc.param, code=int(exc.status))
    return ErrorResponse(error=info)


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(exc).model_dump(), status_code=int(exc.status), headers=exc.headers)


def engine_error(exc: BaseException) -> OpenAIError:
    """Map an exception out of the engine to what the client is told."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):
        return OpenAIError(str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(str(exc), HTTPStatus.TOO_MANY_REQUESTS,
                           headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(f"The engine is not available: {exc}", HTTPStatus.SERVICE_UNAVAILABLE)
    log_unexpected("request handling", exc)
    return OpenAIError("Internal server error", HTTPStatus.INTERNAL_SERVER_ERROR)


def check_engine_serving(engine: EngineClient) -> None:
    dead = engine.dead_error
    if dead is not None:
        raise OpenAIError(f"The engine is dead: {dead}", HTTPStatus.SERVICE_UNAVAILABLE)
    if not engine.is_ready:
        raise OpenAIError(
            "The server is draining and accepts no new requests", HTTPStatus.SERVICE_UNAVAILABLE
        )


def check_model(engine: EngineClient, model: str | None) -> None:
    # A missing model means the served one; any other name is an unknown model, as OpenAI answers.
    if model is not None and model != engine.model_name:
        raise OpenAIError(
            f"The model `{model}` does not exist; this server serves `{engine.model_name}`.",
            HTTPStatus.NOT_FOUND,
            param="model",
            err_type="NotFoundError",
        )


# --------------------------------------------------------------------------------------------- parsing


def validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    if first["type"] == "json_invalid":
        return OpenAIError(f"The request body is not valid JSON: {first['msg']}")
    parts = []
    for err in errors[:4]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"'{loc}': {err['msg']}")
    loc0 = first["loc"][0] if first["loc"] else None
    return OpenAIError("Invalid request: " + "; ".join(parts), param=str(loc0) if loc0 is not None else None)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"{}", strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_length(engine: EngineClient, num_prompt_tokens: int, max_tokens: int | None, what: str) -> int:
    """Check the prompt (and max_tokens) against the context; return the max_tokens to use (None: what the
    context leaves)."""
    limit = engine.max_model_len
    if num_prompt_tokens == 0:
        raise OpenAIError(f"The {what} is empty", param="prompt" if what == "prompt" else "messages")
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if num_prompt_tokens >= limit:  # the input's fault, whatever max_tokens says
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens, but the {what} has "
            f"{num_prompt_tokens} tokens, leaving no room for the completion.",
            param="messages" if what == "messages" else "prompt",
        )
    if max_tokens is None:
        return limit - num_prompt_tokens
    if num_prompt_tokens + max_tokens > limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, {max_tokens} for "
            "the completion). Reduce the length of the input or of max_tokens.",
            param="max_tokens",
        )
    return max_tokens


# -------------------------------------------------------------------------------------------- fan-out


@dataclass
class Job:
    """One engine request of an HTTP request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    finished: bool = False


def make_jobs(request_id: str, prompts: list[list[int]], params: list[SamplingParams], n: int,
              priority: int = 0) -> list[Job]:
    """n engine requests per prompt, named `{i}_{request_id}` (plain `request_id` when there is only one),
    each sample with seed+i when seeded, as vLLM's ParentRequest does."""
    jobs: list[Job] = []
    total = len(prompts) * n
    for p, (ids, base) in enumerate(zip(prompts, params, strict=True)):
        for i in range(n):
            index = p * n + i
            sp = base
            if base.seed is not None and i > 0:
                sp = msgspec.structs.replace(base, seed=base.seed + i)
            rid = request_id if total == 1 else f"{index}_{request_id}"
            jobs.append(Job(index, p, rid, ids, sp, priority))
    return jobs


class GenerationGroup:
    """Runs the engine requests of one HTTP request and merges their deltas in arrival order.

    `aclose()` must run when the caller stops early (client gone, error): it cancels the engine
    iterators, which aborts their requests, and also calls `engine.abort` for every unfinished one, since
    abort is idempotent and a leaked request holds KV blocks until it ends.
    """

    def __init__(self, engine: EngineClient, jobs: list[Job], kv_transfer_params: dict[str, Any] | None):
        self.engine = engine
        self.jobs = jobs
        self._iters = [
            engine.generate(j.prompt_token_ids, j.params, j.request_id, kv_transfer_params, j.priority)
            for j in jobs
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._stream = self._merge()
        self._closed = False

    def __aiter__(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        return self._stream

    async def _merge(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        if len(self.jobs) == 1:
            job = self.jobs[0]
            async for out in self._iters[0]:
                job.finished = job.finished or out.finished
                yield job, out
            job.finished = True
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(k: int) -> None:
            try:
                async for out in self._iters[k]:
                    queue.put_nowait((k, out, None))
                queue.put_nowait((k, None, None))
            except Exception as exc:
                queue.put_nowait((k, None, exc))

        self._tasks = [asyncio.create_task(pump(k)) for k in range(len(self.jobs))]
        pending = len(self.jobs)
        while pending:
            k, delta, exc = await queue.get()
            job = self.jobs[k]
            if exc is not None:
                job.finished = True
                raise exc
            if delta is None:
                job.finished = True
                pending -= 1
                continue
            job.finished = job.finished or delta.finished
            yield job, delta

    async def aclose(self) -> None:
        """Idempotent; the cleanup survives cancellation of the caller."""
        if self._closed:
            return
        self._closed = True
        task = asyncio.create_task(self._cleanup())
        _background.add(task)
        task.add_done_callback(_background.discard)
        await asyncio.shield(task)

    async def _cleanup(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await _aclose(self._stream)
        for it in self._iters:
            await _aclose(it)
        if self.engine.dead_error is not None:
            return
        for job in self.jobs:
            if not job.finished:
                logger.info("aborting request %s: client gone or request failed", job.request_id)
                try:
                    await self.engine.abort(job.request_id)
                except Exception as exc:  # the engine may be shutting down; the request dies with it
                    logger.warning("abort of %s failed: %r", job.request_id, exc)


async def _aclose(it: object) -> None:
    close = getattr(it, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception as exc:
        logger.debug("closing an engine iterator raised %r", exc)


# ----------------------------------------------------------------------------------------- disconnect


async def _wait_disconnect(request: Request) -> None:
    # The body has been read; the next ASGI message is http.disconnect, whenever the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
    """Run `work` while watching the client; cancel it when the client disconnects first.
    Returns (True, result) when it finished, (False, None) when the client left."""
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return True, task.result()
        logger.info("client disconnected from %s before the response", request.url.path)
        return False, None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


# ---------------------------------------------------------------------------------------------- SSE


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so the generation group's cleanup runs
    even when the server reports a disconnect by failing `send` instead of cancelling the stream."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        # No caching, and no buffering by proxies such as nginx: each event is a token the client awaits.
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await _aclose(self.body_iterator)


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI reports -9999.0 for impossible tokens.
    return max(value, -9999.0) if value == value else -9999.0


async def first_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


def log_unexpected(where: str, exc: BaseException) -> None:
    logger.error("unexpected error in %s: %r", where, exc, exc_info=exc)


def finish_reason_of(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    if out.finish_reason == "error":
        raise OpenAIError("The engine failed while generating this request", HTTPStatus.INTERNAL_SERVER_ERROR)
    return out.finish_reason or "stop"


class UsageTracker:
    """Token counts of one HTTP request: each prompt counted once, every choice's output counted."""

    def __init__(self, jobs: list[Job]) -> None:
        self._prompt: dict[int, int] = {j.prompt_index: len(j.prompt_token_ids) for j in jobs}
        self._cached: dict[int, int] = {}
        self._output: dict[int, int] = {j.index: 0 for j in jobs}

    def observe(self, job: Job, out: RequestOutput) -> None:
        self._prompt[job.prompt_index] = out.num_prompt_tokens
        self._cached[job.prompt_index] = max(self._cached.get(job.prompt_index, 0), out.num_cached_tokens)
        self._output[job.index] = out.num_output_tokens

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt.values())
        completion = sum(self._output.values())
        details = PromptTokensDetails(cached_tokens=sum(self._cached.values())) if self._cached else None
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )
