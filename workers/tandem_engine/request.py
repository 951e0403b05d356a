"""The EngineCore's own state of one request (never crosses a process boundary)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from tandem_engine.protocol import EngineCoreRequest
from tandem_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem_engine.core.structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.kv_transfer_params = kv_transfer_params
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.output_token_ids: list[int] = []
        # prompt + output: the sequence whose KV the engine computes.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until scheduled
        self.num_preemptions = 0
        # Chained hashes of this request's full blocks, extended as tokens are appended.
        self.block_hashes: list[int] = []
        self.first_scheduled_time: float | None = None
        # Where the request stands in its grammar (sampling_params.grammar), from before its first step.
        self.grammar: Grammar | None = None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_ids,
            req.arrival_time,
            req.kv_transfer_params,
            req.priority,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
