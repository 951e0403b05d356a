"""Pydantic models of the OpenAI-compatible HTTP API: requests as clients send them, responses as the
official `openai` client parses them, plus the vLLM extensions tandem accepts.

Requests are validated from the raw body in strict JSON mode, so `"max_tokens": "5"` is a 400 naming
`max_tokens`, not a silent conversion.
"""

from __future__ import annotations

import time
import uuid
from http import HTTPStatus
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from tandem_engine.sampling_params import SamplingParams

# The per-request cap on `n` (engine requests fanned out for one HTTP request).
MAX_N = 16
# The most prompts one /v1/completions request may batch.
MAX_PROMPTS = 16
MAX_LOGPROBS = 20
# OpenAI's published default of CreateCompletionRequest.max_tokens (vLLM's too). Chat has none: a chat
# answer may run to the end of the context, and so may a completion that sends `"max_tokens": null`.
COMPLETION_MAX_TOKENS = 16


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do for forward compatibility. NaN and
    # infinities (which Python's JSON accepts) never reach the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(OpenAIModel):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many clients send `"n": null`, `"stream": null` for "not given": treat them so.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# ---------------------------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    object: Literal["error"] = "error"
    error: ErrorInfo


class OpenAIError(Exception):
    """An error answered in OpenAI's shape; raised anywhere in a handler."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _default_type(status)
        self.headers = headers


def _default_type(status: HTTPStatus) -> str:
    if status == HTTPStatus.BAD_REQUEST:
        return "invalid_request_error"
    # vLLM's convention: the status phrase in CamelCase ending in one "Error" ("NotFoundError",
    # "ServiceUnavailableError", "InternalServerError").
    name = status.phrase.title().replace(" ", "").replace("-", "")
    return name if name.endswith("Error") else name + "Error"


# -------------------------------------------------------------------------------------------- requests

# Every integer crosses to the EngineCore as msgpack (and seeds into torch): keep them in int64.
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# seed + i for the n samples must stay in range too.
Seed = Annotated[int, Field(ge=-(2**63), le=INT64_MAX - MAX_N)]


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored

    # vLLM extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    kv_transfer_params: dict[str, Any] | None = None
    # Lower is served first; non-zero only under --scheduling-policy priority.
    priority: Int64 = 0
    # The prompt's and every chunk's token ids in the answer (docs/contracts.md, "Token ids").
    return_token_ids: bool = False
    # tandem extension: continue an answer whose first tokens these are (docs/contracts.md, "Resuming a request").
    resume_token_ids: list[TokenId] | None = None
    # Structured outputs (entrypoints/structured.py): OpenAI's response_format, vLLM's structured_outputs.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           tools_grammar: str | None = None) -> SamplingParams:
        """These sampling fields as SamplingParams; raises OpenAIError for values out of range, and for a
        grammar (`tools_grammar`: the one chat's tool_choice demands) that cannot be compiled."""
        if not 1 <= self.n <= MAX_N:
            raise OpenAIError(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise OpenAIError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options can only be set when stream is true", param="stream_options")
        if self.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias")
        from tandem_engine.entrypoints.structured import request_grammar  # it raises this module's OpenAIError

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": [s for s in stop if s],
            "stop_token_ids": list(self.stop_token_ids or []),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "grammar": request_grammar(self.response_format, self.structured_outputs, tools_grammar),
        }
        optional = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
        for name in (*optional, "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        params = SamplingParams(**fields)
        try:
            params.validate()
        except ValueError as exc:
            message = str(exc)
            head = message.split(" ", 1)[0]
            raise OpenAIError(message, param=head if head in fields else None) from None
        return params


class CompletionRequest(SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    max_tokens: Int64 | None = COMPLETION_MAX_TOKENS
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # As for every request, except `"max_tokens": null`: to the end of the context, as vLLM reads it
        # (how a router resumes a chat that set no limit on /v1/completions).
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "max_tokens"}
        return data


class ContentPart(RequestModel):
    """Any content part; only `text` parts are served, the rest are rejected with a 400."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, ... pass through to templates
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    # Tool calling (entrypoints/tools.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # A chat's tools render into its prompt, as on /v1/chat/completions.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# ------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatLogProb(OpenAIModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[ChatLogProbsContent] | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # The calls parsed out of the answer (OpenAI's shape); left out when there are none.
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: not v)


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="plain")
    def _without_nulls(self) -> dict[str, Any]:
        # A delta carries only what changed: `{}` on a bare finish chunk, never `"role": null`.
        out: dict[str, Any] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


LogProbsT = TypeVar("LogProbsT", bound=OpenAIModel)


def _is_none(value: object) -> bool:
    return value is None


def token_ids_field() -> Any:
    """A `token_ids` or `prompt_token_ids` field, left out of the JSON unless the client asked for ids."""
    return Field(default=None, exclude_if=_is_none)


class Choice(OpenAIModel, Generic[LogProbsT]):
    """What every choice carries; each endpoint adds its text (`text`, `message` or `delta`)."""

    index: int
    logprobs: LogProbsT | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the choice; None for EOS, length or abort.
    stop_reason: int | str | None = None
    # With `return_token_ids`: the ids of this choice's text (of this chunk's, when streamed).
    token_ids: list[int] | None = token_ids_field()


class CompletionChoice(Choice[CompletionLogProbs]):
    text: str
    # With `return_token_ids`: the prompt of this choice, on its first chunk when streamed (vLLM's place).
    prompt_token_ids: list[int] | None = token_ids_field()


class ChatCompletionChoice(Choice[ChatLogProbs]):
    message: AssistantMessage


class ChatCompletionStreamChoice(Choice[ChatLogProbs]):
    delta: DeltaMessage


ChoiceT = TypeVar("ChoiceT", bound=Choice[Any])


class Answer(OpenAIModel, Generic[ChoiceT]):
    """The envelope of every answer: a whole response, or one chunk of a stream (`usage` only on the
    last chunk, when the client asked for it)."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChoiceT]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class WholeAnswer(Answer[ChoiceT], Generic[ChoiceT]):
    """A non-streamed answer: usage always, and the KV handle a prefill-only request leaves."""

    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class CompletionResponse(WholeAnswer[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class CompletionStreamResponse(Answer[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatCompletionResponse(WholeAnswer[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    # With `return_token_ids`: the rendered chat prompt (vLLM puts it here, not on the choice).
    prompt_token_ids: list[int] | None = token_ids_field()


class ChatCompletionStreamResponse(Answer[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    # With `return_token_ids`: on the opening (role) chunk of each choice.
    prompt_token_ids: list[int] | None = token_ids_field()


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIModel):
    prompt: str
