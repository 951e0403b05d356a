"""The skeleton both generating endpoints share: parse and check the request, fan it out into engine
requests, then answer with one JSON body or with an SSE stream that ends in `data: [DONE]`.

An endpoint fills in three hooks: `prepare` (its own checks, the prompts rendered or tokenized, their
sampling params), `response` (the whole answer as JSON) and `chunk` (one stream event); `opening` adds
events before the first token where the endpoint has any (chat's role chunks).

With `return_token_ids`, every choice carries the ids of its text and the prompt's ids come once per
choice (docs/contracts.md, "Token ids"): the hooks find both on ChoiceOutput.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request, Response
from pydantic import BaseModel

from tandem_engine.entrypoints.openai_protocol import (
    OpenAIError,
    SamplingRequest,
    UsageInfo,
    now,
    random_id,
)
from tandem_engine.entrypoints.serving_common import (
    CLIENT_CLOSED,
    SSE_DONE,
    GenerationGroup,
    Job,
    SSEResponse,
    UsageTracker,
    check_engine_serving,
    check_model,
    engine_error,
    error_body,
    finish_reason_of,
    first_or_none,
    make_jobs,
    parse_body,
    sse,
    unless_disconnected,
)
from tandem_engine.frontend.interface import EngineClient, RequestOutput, TokenLogprob
from tandem_engine.sampling_params import SamplingParams

RequestT = TypeVar("RequestT", bound=SamplingRequest)


@dataclass
class ChoiceOutput:
    """One choice as the hooks see it: all of it for a response, one delta of it for a stream chunk."""

    index: int
    text: str = ""
    # One per token, each with the alternatives the client asked for; None when it asked for none.
    logprobs: list[TokenLogprob] | None = None
    # Characters of this choice's token texts before `logprobs` (completions' `text_offset`).
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With `return_token_ids`: the ids of `text` (all of them once finished), and the prompt's ids on
    # the choice's first chunk (and on a whole answer); None otherwise.
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class Prepared:
    """The engine's view of one HTTP request: token ids and sampling params per prompt."""

    prompts: list[list[int]]
    params: list[SamplingParams]


class OpenAIServing(ABC, Generic[RequestT]):
    """Serves one endpoint; `create` is its FastAPI handler."""

    request_type: type[RequestT]
    id_prefix: str  # "cmpl", "chatcmpl"

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    @abstractmethod
    def prepare(self, req: RequestT) -> Prepared:
        """Check what only this endpoint accepts, render or tokenize the prompts, build their params."""

    @abstractmethod
    def response(
        self, request_id: str, choices: list[ChoiceOutput], usage: UsageInfo, kv: dict[str, Any] | None
    ) -> BaseModel:
        """The non-streamed answer."""

    @abstractmethod
    def chunk(
        self, request_id: str, created: int, choices: list[ChoiceOutput], usage: UsageInfo | None
    ) -> BaseModel:
        """One stream event: one choice's delta, or no choice and the usage of the whole request."""

    def opening(self, request_id: str, created: int, jobs: list[Job], token_ids: bool) -> Sequence[BaseModel]:
        """Events sent before any token (`token_ids`: the client asked for `return_token_ids`)."""
        return []

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, self.request_type)
        check_model(self.engine, req.model)
        check_engine_serving(self.engine)
        if req.priority != 0 and self.engine.scheduling_policy != "priority":
            raise OpenAIError(f"priority {req.priority} needs the engine's --scheduling-policy priority",
                              param="priority")
        prepared = self.prepare(req)
        if req.kv_transfer_params is not None and len(prepared.prompts) * req.n > 1:
            raise OpenAIError("kv_transfer_params needs a single prompt and n=1", param="kv_transfer_params")
        request_id = random_id(self.id_prefix)
        jobs = make_jobs(request_id, prepared.prompts, prepared.params, req.n, req.priority)
        group = GenerationGroup(self.engine, jobs, req.kv_transfer_params)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return await self._stream(request, request_id, group, include_usage, req.return_token_ids)
        collect = self._collect(request_id, group, req.return_token_ids)
        ok, response = await unless_disconnected(request, collect)
        return response if ok and response is not None else Response(status_code=CLIENT_CLOSED)

    async def _collect(self, request_id: str, group: GenerationGroup, token_ids: bool) -> Response:
        choices = {j.index: ChoiceOutput(j.index, logprobs=_no_logprobs_yet(j)) for j in group.jobs}
        if token_ids:
            for job in group.jobs:
                choices[job.index].token_ids = []
                choices[job.index].prompt_token_ids = job.prompt_token_ids
        texts: dict[int, list[str]] = {j.index: [] for j in group.jobs}
        usage = UsageTracker(group.jobs)
        kv_params: dict[str, Any] | None = None
        try:
            async for job, out in group:
                choice = choices[job.index]
                texts[job.index].append(out.text)
                usage.observe(job, out)
                if choice.logprobs is not None:
                    choice.logprobs += _shown_logprobs(job, out) or []
                if choice.token_ids is not None:
                    choice.token_ids += out.token_ids
                if out.finished:
                    choice.finish_reason = finish_reason_of(out)
                    choice.stop_reason = out.stop_reason
                    kv_params = out.kv_transfer_params or kv_params
        finally:
            await group.aclose()
        for index, choice in choices.items():
            choice.text = "".join(texts[index])
        body = self.response(request_id, [c for _, c in sorted(choices.items())], usage.usage(), kv_params)
        return Response(content=body.model_dump_json(), media_type="application/json")

    async def _stream(
        self, request: Request, request_id: str, group: GenerationGroup, include_usage: bool, token_ids: bool
    ) -> Response:
        # Wait for the first delta before answering, so an invalid request is still a plain HTTP error.
        try:
            ok, first = await unless_disconnected(request, first_or_none(aiter(group)))
        except BaseException:
            await group.aclose()
            raise
        if not ok:
            await group.aclose()
            return Response(status_code=CLIENT_CLOSED)
        return SSEResponse(self._events(request_id, group, first, include_usage, token_ids))

    async def _events(
        self,
        request_id: str,
        group: GenerationGroup,
        first: tuple[Job, RequestOutput] | None,
        include_usage: bool,
        token_ids: bool,
    ) -> AsyncIterator[str]:
        created = now()
        usage = UsageTracker(group.jobs)
        offsets = {job.index: 0 for job in group.jobs}
        # Choices whose prompt ids are still owed to the client (on their first chunk).
        owe_prompt = {job.index for job in group.jobs} if token_ids else set()

        def event(job: Job, out: RequestOutput) -> str | None:
            usage.observe(job, out)
            if not out.text and not out.token_ids and not out.finished:
                return None
            logprobs = _shown_logprobs(job, out)
            choice = ChoiceOutput(
                job.index,
                out.text,
                logprobs,
                offsets[job.index],
                finish_reason_of(out),
                out.stop_reason if out.finished else None,
                token_ids=list(out.token_ids) if token_ids else None,
            )
            if job.index in owe_prompt:
                owe_prompt.discard(job.index)
                choice.prompt_token_ids = job.prompt_token_ids
            offsets[job.index] += sum(len(lp.token) for lp in logprobs or [])
            return sse(self.chunk(request_id, created, [choice], None))

        try:
            for opening in self.opening(request_id, created, group.jobs, token_ids):
                yield sse(opening)
            if first is not None:
                data = event(*first)
                if data is not None:
                    yield data
            async for job, out in group:
                data = event(job, out)
                if data is not None:
                    yield data
            if include_usage:
                yield sse(self.chunk(request_id, created, [], usage.usage()))
        except Exception as exc:
            yield sse(error_body(engine_error(exc)))
        finally:
            await group.aclose()
        yield SSE_DONE


def _shown_logprobs(job: Job, out: RequestOutput) -> list[TokenLogprob] | None:
    """The delta's logprobs with as many alternatives as the client asked for; None when it asked for
    no logprobs (the engine's `logprobs` is the number of alternatives per token)."""
    num_top = job.params.logprobs
    if num_top is None:
        return None
    return [dataclasses.replace(lp, top=lp.top[:num_top]) for lp in out.logprobs or []]


def _no_logprobs_yet(job: Job) -> list[TokenLogprob] | None:
    return [] if job.params.logprobs is not None else None
