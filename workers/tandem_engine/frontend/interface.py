"""What the HTTP layer needs from an engine: the contract between entrypoints/ and the async frontend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tandem_engine.config import SchedulingPolicy
from tandem_engine.protocol import EngineCoreOutputs, EngineCoreRequest, ReadyMessage
from tandem_engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineDeadError(RuntimeError):
    """The EngineCore died: fatal for the whole server (HTTP 503, non-zero exit)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (--max-waiting-requests): HTTP 429 with `Retry-After`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestError(ValueError):
    """A single request is invalid: HTTP 400 with this message, naming `param` when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class TokenCandidate:
    token_id: int
    token: str  # decoded text of this one token: U+FFFD where it holds only part of a character
    token_bytes: bytes  # its own bytes: part of a character's UTF-8 where it splits one
    logprob: float


@dataclass
class TokenLogprob(TokenCandidate):
    """The sampled token and the most likely alternatives at its position, best first."""

    top: list[TokenCandidate] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One delta of one request: what was generated since the previous RequestOutput."""

    request_id: str
    # The new text since the last output, and the tokens whose text it completes: before the final output,
    # `text` is exactly the text of `token_ids` decoded after the prompt and every earlier token, so the
    # tokens of text still held back (a partial character, a possible stop string) come later. The final
    # output carries every token not yet reported, whether or not its text is shown (a stop string).
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token of `token_ids` when requested
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    kv_transfer_params: dict[str, Any] | None = None  # set on the final output of a prefill request


class EngineClient(ABC):
    model_name: str  # the served id, e.g. "smollm2-135m-instruct"
    max_model_len: int
    scheduling_policy: SchedulingPolicy = "fcfs"

    @abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def detokenize(self, token_ids: list[int]) -> str: ...

    # The tool-call format flag (entrypoints/tools.py): auto, smollm2, hermes.
    tool_call_parser: str = "auto"

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> str:
        """Render chat messages (and `tools`) to the prompt text, through the model's chat template or
        `chat_template`; raises RequestError on malformed messages."""

    def model_chat_template(self) -> str | None:
        """The model's own chat template (its Jinja text), where it has one."""
        return None

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, where the vocabulary has one."""
        return None

    @abstractmethod
    def tokenizer_spec(self) -> bytes:
        """The JSON body of GET /tokenizer (frontend/tokenizer_spec.py), built once. Raises TypeError
        when the tokenizer cannot be served (it is not a fast tokenizer)."""

    @abstractmethod
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas until one with finished=True. Raises RequestError for an invalid request,
        EngineOverloadedError when it would wait past --max-waiting-requests, EngineDeadError if the
        engine died; all of them before the first delta. Cancelling the iterator (client gone) aborts
        the request."""

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @property
    @abstractmethod
    def is_ready(self) -> bool:
        """False while draining for shutdown or after the engine died: /health answers 503."""

    @property
    @abstractmethod
    def dead_error(self) -> BaseException | None: ...


class EngineCores(Protocol):
    """What AsyncLLM asks of the engine cores behind it: the EngineCore processes over ZMQ
    (frontend/core_client.py's CoreClient), or simulated cores in the same event loop (tandem_engine/sim)."""

    ready: list[ReadyMessage]  # one per core, in order

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_dtype(self) -> str: ...

    def run(self, on_outputs: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]) -> None: ...

    async def add_request(self, req: EngineCoreRequest) -> None: ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def shutdown(self, drain_s: float = 30.0) -> None: ...
