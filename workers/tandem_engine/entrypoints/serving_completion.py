"""POST /v1/completions: prompt (text, token ids, or a batch of either) -> n engine requests per prompt ->
one JSON response or an SSE stream of `text_completion` chunks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response

from tandem_engine.entrypoints.openai_protocol import (
    MAX_PROMPTS,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    OpenAIError,
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
    check_length,
    check_model,
    clamp_logprob,
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

logger = logging.getLogger(__name__)


class LogprobsBuilder:
    """OpenAI's completions logprobs: parallel lists, `text_offset` counting characters of the output,
    `top_logprobs` holding the sampled token plus the top-N alternatives (N+1 entries at most)."""

    def __init__(self, num_top: int) -> None:
        self.num_top = num_top
        self.offset = 0

    def build(self, logprobs: list[TokenLogprob] | None) -> CompletionLogProbs:
        result = CompletionLogProbs()
        for lp in logprobs or []:
            result.tokens.append(lp.token)
            result.token_logprobs.append(clamp_logprob(lp.logprob))
            result.text_offset.append(self.offset)
            self.offset += len(lp.token)
            top: dict[str, float] = {lp.token: clamp_logprob(lp.logprob)}
            for _, text, value in lp.top[: self.num_top]:
                top.setdefault(text, clamp_logprob(value))
            result.top_logprobs.append(top)
        return result


def extend(into: CompletionLogProbs, more: CompletionLogProbs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.text_offset += more.text_offset
    into.top_logprobs += more.top_logprobs


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionServing:
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        check_model(self.engine, req.model)
        check_engine_serving(self.engine)
        if req.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        if req.echo:
            raise OpenAIError("echo is not supported", param="echo")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of is not supported (it must equal n when given)", param="best_of")
        prompts = self._tokenize_prompts(req)
        params = [
            req.to_sampling_params(check_length(self.engine, len(p), req.max_tokens, "prompt"), req.logprobs)
            for p in prompts
        ]
        if req.kv_transfer_params is not None and len(prompts) * req.n > 1:
            raise OpenAIError("kv_transfer_params needs a single prompt and n=1", param="kv_transfer_params")
        request_id = random_id("cmpl")
        jobs = make_jobs(request_id, prompts, params, req.n)
        group = GenerationGroup(self.engine, jobs, req.kv_transfer_params)
        if req.stream:
            return await self._stream(request, req, request_id, group)
        ok, response = await unless_disconnected(request, self._collect(req, request_id, group))
        return response if ok and response is not None else Response(status_code=CLIENT_CLOSED)

    def _tokenize_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if prompt is None:
            raise OpenAIError("prompt is required", param="prompt")
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            batch: list[Any] = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise OpenAIError("The prompt is empty", param="prompt")
        if len(batch) > MAX_PROMPTS:
            raise OpenAIError(f"At most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
        out: list[list[int]] = []
        for p in batch:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("The prompt is empty", param="prompt")
                out.append(self.engine.tokenize(p, add_special_tokens=req.add_special_tokens))
            else:
                out.append(list(p))
        return out

    async def _collect(self, req: CompletionRequest, request_id: str, group: GenerationGroup) -> Response:
        states = {job.index: ChoiceState() for job in group.jobs}
        builders = {
            job.index: LogprobsBuilder(req.logprobs) for job in group.jobs if req.logprobs is not None
        }
        usage = UsageTracker(group.jobs)
        kv_params: dict[str, Any] | None = None
        try:
            async for job, out in group:
                state = states[job.index]
                state.text.append(out.text)
                usage.observe(job, out)
                if job.index in builders:
                    more = builders[job.index].build(out.logprobs)
                    if state.logprobs is None:
                        state.logprobs = more
                    else:
                        extend(state.logprobs, more)
                if out.finished:
                    state.finish_reason = finish_reason_of(out)
                    state.stop_reason = out.stop_reason
                    kv_params = out.kv_transfer_params or kv_params
        finally:
            await group.aclose()
        choices = [
            CompletionChoice(
                index=i,
                text="".join(s.text),
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in sorted(states.items())
        ]
        body = CompletionResponse(
            id=request_id,
            model=self.engine.model_name,
            choices=choices,
            usage=usage.usage(),
            kv_transfer_params=kv_params,
        )
        return Response(content=body.model_dump_json(), media_type="application/json")

    async def _stream(
        self, request: Request, req: CompletionRequest, request_id: str, group: GenerationGroup
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
        return SSEResponse(self._events(req, request_id, group, first))

    async def _events(
        self,
        req: CompletionRequest,
        request_id: str,
        group: GenerationGroup,
        first: tuple[Job, RequestOutput] | None,
    ) -> AsyncIterator[str]:
        created = now()
        model = self.engine.model_name
        builders = {
            job.index: LogprobsBuilder(req.logprobs) for job in group.jobs if req.logprobs is not None
        }
        usage = UsageTracker(group.jobs)
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        def chunk(job: Job, out: RequestOutput) -> str | None:
            usage.observe(job, out)
            if not out.text and not out.token_ids and not out.finished:
                return None
            builder = builders.get(job.index)
            choice = CompletionChoice(
                index=job.index,
                text=out.text,
                logprobs=builder.build(out.logprobs) if builder is not None else None,
                finish_reason=finish_reason_of(out),
                stop_reason=out.stop_reason if out.finished else None,
            )
            return sse(
                CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
            )

        try:
            if first is not None:
                data = chunk(*first)
                if data is not None:
                    yield data
            async for job, out in group:
                data = chunk(job, out)
                if data is not None:
                    yield data
            if include_usage:
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage.usage()
                )
                yield sse(final)
        except Exception as exc:
            err = engine_error(exc)
            yield sse(error_body(err))
        finally:
            await group.aclose()
        yield SSE_DONE
