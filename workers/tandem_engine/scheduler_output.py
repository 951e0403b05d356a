"""What a scheduler step hands the model runner, and what the runner hands back: the types the engine core
and the worker share, in a module of their own so that the worker imports nothing of the core."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem_engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # computed tokens before this step = position of the first scheduled token
    num_tokens: int
    block_ids: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
