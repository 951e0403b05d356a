"""POST /v1/chat/completions: messages -> chat template -> n engine requests -> one JSON response or an
SSE stream of `chat.completion.chunk`s (a role chunk per choice first, then content deltas)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response

from tandem_engine.entrypoints.openai_protocol import (
    MAX_LOGPROBS,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessage,
    DeltaMessage,
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
from tandem_engine.frontend.interface import EngineClient, RequestError, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content flattened to text (only text parts are served)."""
    if not messages:
        raise OpenAIError("messages must not be empty", param="messages")
    result: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        item = msg.model_dump(exclude_none=True)
        if isinstance(msg.content, list):
            texts: list[str] = []
            for part in msg.content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(
                        f"messages[{i}]: content parts of type {part.type!r} are not supported, only text",
                        param="messages",
                    )
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        result.append(item)
    return result


def render_chat(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    try:
        text = engine.apply_chat_template(template_messages(messages), add_generation_prompt)
    except RequestError:
        raise
    except ValueError as exc:
        raise OpenAIError(f"Invalid messages: {exc}", param="messages") from None
    # The template already wrote BOS and every other special token it wants.
    return engine.tokenize(text, add_special_tokens=False)


def chat_logprobs(logprobs: list[TokenLogprob] | None, num_top: int) -> ChatLogProbs:
    content = [
        ChatLogProbsContent(
            token=lp.token,
            logprob=clamp_logprob(lp.logprob),
            bytes=list(lp.token.encode("utf-8")),
            top_logprobs=[
                ChatLogProb(token=text, logprob=clamp_logprob(value), bytes=list(text.encode("utf-8")))
                for _, text, value in lp.top[:num_top]
            ],
        )
        for lp in logprobs or []
    ]
    return ChatLogProbs(content=content)


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatServing:
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def create(self, request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        check_model(self.engine, req.model)
        check_engine_serving(self.engine)
        if req.tools and req.tool_choice != "none":
            raise OpenAIError("tool calling is not supported (send tool_choice 'none')", param="tools")
        num_top = self._num_top_logprobs(req)
        prompt = render_chat(self.engine, req.messages, req.add_generation_prompt)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = check_length(self.engine, len(prompt), requested, "messages")
        params = req.to_sampling_params(max_tokens, num_top)
        if req.kv_transfer_params is not None and req.n > 1:
            raise OpenAIError("kv_transfer_params needs n=1", param="kv_transfer_params")
        request_id = random_id("chatcmpl")
        jobs = make_jobs(request_id, [prompt], [params], req.n)
        group = GenerationGroup(self.engine, jobs, req.kv_transfer_params)
        if req.stream:
            return await self._stream(request, req, request_id, group, num_top)
        ok, response = await unless_disconnected(request, self._collect(request_id, group, num_top))
        return response if ok and response is not None else Response(status_code=CLIENT_CLOSED)

    @staticmethod
    def _num_top_logprobs(req: ChatCompletionRequest) -> int | None:
        """The engine's `logprobs` (top-N per token) for this request; None when not asked for."""
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                    param="top_logprobs",
                )
        if not req.logprobs:
            return None
        return req.top_logprobs or 0

    async def _collect(self, request_id: str, group: GenerationGroup, num_top: int | None) -> Response:
        states = {job.index: ChoiceState() for job in group.jobs}
        usage = UsageTracker(group.jobs)
        kv_params: dict[str, Any] | None = None
        try:
            async for job, out in group:
                state = states[job.index]
                state.text.append(out.text)
                usage.observe(job, out)
                if num_top is not None:
                    more = chat_logprobs(out.logprobs, num_top)
                    if state.logprobs is None:
                        state.logprobs = more
                    else:
                        (state.logprobs.content or []).extend(more.content or [])
                if out.finished:
                    state.finish_reason = finish_reason_of(out)
                    state.stop_reason = out.stop_reason
                    kv_params = out.kv_transfer_params or kv_params
        finally:
            await group.aclose()
        choices = [
            ChatCompletionChoice(
                index=i,
                message=AssistantMessage(content="".join(s.text)),
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in sorted(states.items())
        ]
        body = ChatCompletionResponse(
            id=request_id,
            model=self.engine.model_name,
            choices=choices,
            usage=usage.usage(),
            kv_transfer_params=kv_params,
        )
        return Response(content=body.model_dump_json(), media_type="application/json")

    async def _stream(
        self,
        request: Request,
        req: ChatCompletionRequest,
        request_id: str,
        group: GenerationGroup,
        num_top: int | None,
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
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return SSEResponse(self._events(request_id, group, first, num_top, include_usage))

    async def _events(
        self,
        request_id: str,
        group: GenerationGroup,
        first: tuple[Job, RequestOutput] | None,
        num_top: int | None,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        created = now()
        model = self.engine.model_name
        usage = UsageTracker(group.jobs)

        def frame(choice: ChatCompletionStreamChoice) -> str:
            return sse(
                ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
            )

        def chunk(job: Job, out: RequestOutput) -> str | None:
            usage.observe(job, out)
            if not out.text and not out.token_ids and not out.finished:
                return None
            choice = ChatCompletionStreamChoice(
                index=job.index,
                delta=DeltaMessage(content=out.text or None),
                logprobs=chat_logprobs(out.logprobs, num_top) if num_top is not None else None,
                finish_reason=finish_reason_of(out),
                stop_reason=out.stop_reason if out.finished else None,
            )
            return frame(choice)

        try:
            for job in group.jobs:
                yield frame(
                    ChatCompletionStreamChoice(
                        index=job.index, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            if first is not None:
                data = chunk(*first)
                if data is not None:
                    yield data
            async for job, out in group:
                data = chunk(job, out)
                if data is not None:
                    yield data
            if include_usage:
                final = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage.usage()
                )
                yield sse(final)
        except Exception as exc:
            yield sse(error_body(engine_error(exc)))
        finally:
            await group.aclose()
        yield SSE_DONE
