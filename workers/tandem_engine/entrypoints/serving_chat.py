"""POST /v1/chat/completions: messages -> chat template -> n engine requests -> one JSON response or an
SSE stream of `chat.completion.chunk`s (a role chunk per choice first, then content deltas)."""

from __future__ import annotations

from typing import Any

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
    UsageInfo,
)
from tandem_engine.entrypoints.serving_base import ChoiceOutput, OpenAIServing, Prepared
from tandem_engine.entrypoints.serving_common import Job, check_length, clamp_logprob
from tandem_engine.entrypoints.tools import (
    END,
    START,
    ToolPlan,
    calls_grammar,
    parse_tools,
    template_arguments,
    tool_format,
)
from tandem_engine.frontend.chat_templates import tools_template
from tandem_engine.frontend.interface import EngineClient, RequestError, TokenCandidate, TokenLogprob


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


def render_chat(engine: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                parallel_tool_calls: bool | None = None) -> tuple[list[int], ToolPlan]:
    """The prompt's token ids, and what the request asks of its tools. A conversation with tools, or with calls
    and results in it, goes through a template that can write them: the model's own where it renders tools,
    else SmolLM2's ChatML with tools (entrypoints/tools.py)."""
    own = engine.model_chat_template()
    plan = parse_tools(tools, tool_choice, parallel_tool_calls, tool_format(own, engine.tool_call_parser))
    with_tools = plan.parses or any(m.role == "tool" or getattr(m, "tool_calls", None) for m in messages)
    template = tools_template(own) if with_tools else None
    try:
        text = engine.apply_chat_template(template_arguments(template_messages(messages)), add_generation_prompt,
                                          plan.template_tools, template)
    except RequestError:
        raise
    except ValueError as exc:
        raise OpenAIError(f"Invalid messages: {exc}", param="messages") from None
    # The template already wrote BOS and every other special token it wants.
    return engine.tokenize(text, add_special_tokens=False), plan


def chat_logprob(token: TokenCandidate) -> ChatLogProb:
    # `bytes` are the token's own: for a token holding part of a character, that part's UTF-8 bytes, so
    # that the bytes of consecutive tokens join into the character (its `token` text is U+FFFD).
    return ChatLogProb(token=token.token, logprob=clamp_logprob(token.logprob), bytes=list(token.token_bytes))


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> ChatLogProbs | None:
    if logprobs is None:
        return None
    content = [
        ChatLogProbsContent(**chat_logprob(lp).model_dump(), top_logprobs=[chat_logprob(t) for t in lp.top])
        for lp in logprobs
    ]
    return ChatLogProbs(content=content)


def num_top_logprobs(req: ChatCompletionRequest) -> int | None:
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


class ChatServing(OpenAIServing[ChatCompletionRequest]):
    request_type = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def prepare(self, req: ChatCompletionRequest) -> Prepared:
        num_top = num_top_logprobs(req)
        prompt, plan = render_chat(self.engine, req.messages, req.add_generation_prompt, req.tools, req.tool_choice,
                                   req.parallel_tool_calls)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = check_length(self.engine, len(prompt), requested, "messages")
        grammar = calls_grammar(plan, {t: self.engine.special_token_id(t) for t in (START, END)})
        params = req.to_sampling_params(max_tokens, num_top, grammar)
        return Prepared([prompt], [params], plan if plan.parses else None)

    def response(
        self, request_id: str, choices: list[ChoiceOutput], usage: UsageInfo, kv: dict[str, Any] | None
    ) -> ChatCompletionResponse:
        shaped = [
            ChatCompletionChoice(
                index=c.index,
                message=AssistantMessage(content=c.text if c.text or not c.tool_calls else None,
                                         tool_calls=c.tool_calls),
                logprobs=chat_logprobs(c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
            )
            for c in choices
        ]
        model = self.engine.model_name
        # One prompt per chat request: every choice carries the same prompt ids.
        prompt = choices[0].prompt_token_ids if choices else None
        return ChatCompletionResponse(id=request_id, model=model, choices=shaped, usage=usage, kv_transfer_params=kv,
                                      prompt_token_ids=prompt)

    def chunk(
        self, request_id: str, created: int, choices: list[ChoiceOutput], usage: UsageInfo | None
    ) -> ChatCompletionStreamResponse:
        shaped = [
            ChatCompletionStreamChoice(
                index=c.index,
                delta=DeltaMessage(content=c.text or None, tool_calls=c.tool_calls),
                logprobs=chat_logprobs(c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
            )
            for c in choices
        ]
        return self._chunk(request_id, created, shaped, usage)

    def opening(
        self, request_id: str, created: int, jobs: list[Job], token_ids: bool
    ) -> list[ChatCompletionStreamResponse]:
        # The prompt's ids ride on each choice's role chunk, the first chunk of the stream (vLLM's place).
        role = DeltaMessage(role="assistant", content="")
        return [self._chunk(request_id, created, [ChatCompletionStreamChoice(index=j.index, delta=role)], None,
                            j.prompt_token_ids if token_ids else None)
                for j in jobs]

    def _chunk(
        self,
        request_id: str,
        created: int,
        choices: list[ChatCompletionStreamChoice],
        usage: UsageInfo | None,
        prompt_token_ids: list[int] | None = None,
    ) -> ChatCompletionStreamResponse:
        model = self.engine.model_name
        return ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                            prompt_token_ids=prompt_token_ids)
