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

import msgspec
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
from tandem_engine.entrypoints.tools import ToolCallParser, ToolPlan
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
    # Chat with tools: the calls parsed out of the text (OpenAI's shape; streamed, with their index).
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class Prepared:
    """The engine's view of one HTTP request: token ids and sampling params per prompt, and on chat the tools
    whose calls are parsed out of each answer."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    tools: ToolPlan | None = None
    resumed_text: str = ""  # the text of `resume_token_ids`, which the tool-call parser has read already


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
        if req.resume_token_ids:
            self._resume(req, prepared)
        if req.kv_transfer_params is not None and len(prepared.prompts) * req.n > 1:
            raise OpenAIError("kv_transfer_params needs a single prompt and n=1", param="kv_transfer_params")
        request_id = random_id(self.id_prefix)
        jobs = make_jobs(request_id, prepared.prompts, prepared.params, req.n, req.priority)
        group = GenerationGroup(self.engine, jobs, req.kv_transfer_params)
        parses = prepared.tools is not None and prepared.tools.parses
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return await self._stream(request, request_id, group, include_usage, req.return_token_ids,
                                      prepared.resumed_text if parses else None)
        collect = self._collect(request_id, group, req.return_token_ids, prepared.resumed_text if parses else None)
        ok, response = await unless_disconnected(request, collect)
        return response if ok and response is not None else Response(status_code=CLIENT_CLOSED)

    def _resume(self, req: RequestT, prepared: Prepared) -> None:
        """Continue an answer whose first tokens are `resume_token_ids`: they follow the prompt, count against
        max_tokens and min_tokens, and the grammar and the tool-call parser start after them."""
        ids = list(req.resume_token_ids or [])
        if len(prepared.prompts) * req.n != 1:
            raise OpenAIError("resume_token_ids needs a single prompt and n=1", param="resume_token_ids")
        (params,) = prepared.params
        if len(ids) >= params.max_tokens:
            raise OpenAIError(f"resume_token_ids holds {len(ids)} tokens, max_tokens leaves {params.max_tokens}: "
                              "nothing is left to generate", param="resume_token_ids")
        prepared.prompts[0] = prepared.prompts[0] + ids
        prepared.params[0] = msgspec.structs.replace(
            params, max_tokens=params.max_tokens - len(ids), min_tokens=max(0, params.min_tokens - len(ids)),
            resumed_tokens=len(ids))
        prepared.resumed_text = self.engine.detokenize(ids)

    async def _collect(self, request_id: str, group: GenerationGroup, token_ids: bool,
                       parse_after: str | None) -> Response:
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
            if parse_after is not None:
                parser = ToolCallParser(parse_after)
                choice.text, calls = parser.read(choice.text, final=True)
                choice.tool_calls = [c.as_openai() for c in calls] or None  # a resumed answer's: its new calls
                choice.finish_reason = parser.finish_reason(choice.finish_reason)
        body = self.response(request_id, [c for _, c in sorted(choices.items())], usage.usage(), kv_params)
        return Response(content=body.model_dump_json(), media_type="application/json")

    async def _stream(
        self, request: Request, request_id: str, group: GenerationGroup, include_usage: bool, token_ids: bool,
        parse_after: str | None = None,
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
        return SSEResponse(self._events(request_id, group, first, include_usage, token_ids, parse_after))

    async def _events(
        self,
        request_id: str,
        group: GenerationGroup,
        first: tuple[Job, RequestOutput] | None,
        include_usage: bool,
        token_ids: bool,
        parse_after: str | None = None,
    ) -> AsyncIterator[str]:
        """`parse_after`: tool calls are parsed out of the text, which follows this text (a resumed answer's)."""
        created = now()
        parsers = {job.index: ToolCallParser(parse_after) for job in group.jobs} if parse_after is not None else {}
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
            if (parser := parsers.get(job.index)) is not None:
                before = len(parser.calls)
                choice.text, calls = parser.read(out.text, final=out.finished)
                choice.finish_reason = parser.finish_reason(choice.finish_reason)
                if calls:
                    choice.tool_calls = [c.as_openai(index) for index, c in enumerate(calls, start=before)]
                if not (choice.text or calls or out.finished or logprobs or token_ids):
                    return None
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
