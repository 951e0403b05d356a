"""Everything that crosses the frontend <-> EngineCore ZMQ boundary, as msgspec Structs.

New requests cross whole (EngineCoreRequest); running ones only as ids (aborts). Outputs cross as
per-step deltas (EngineCoreOutput), batched per step with the scheduler's stats.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tandem_engine.sampling_params import SamplingParams


class RequestType(enum.IntEnum):
    ADD = 0
    ABORT = 1
    SHUTDOWN = 2


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0  # lower is served first under --scheduling-policy priority


class Logprobs(msgspec.Struct, array_like=True):
    """For each new token: the sampled token's logprob and the top-k alternatives."""

    sampled: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that matched
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    # Seconds between arrival at the EngineCore and first scheduling; set on the first output only.
    queue_time: float | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up since the previous stats
    prefix_cache_hits: int  # tokens found since the previous stats
    kv_blocks_held_for_transfer: int = 0
    kv_transfer_sent_blocks: int = 0
    kv_transfer_received_blocks: int = 0
    kv_transfer_failures: int = 0
    kv_leases_expired: int = 0
    kv_transfer_seconds: list[float] = msgspec.field(default_factory=list)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Set only on the last message of a dying engine: the frontend fails every request with it.
    dead_error: str | None = None


class ReadyMessage(msgspec.Struct, tag=True):
    engine_index: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    pid: int
    engine_id: str = ""
    startup_seconds: float = 0.0
    kv_cache_dtype: str = ""  # what the KV cache stores, as --kv-cache-dtype spells it ("bfloat16")
    dtype: str = ""  # the model's compute dtype, "float32" (what `--dtype auto` resolved to)


class FailedMessage(msgspec.Struct, tag=True):
    engine_index: int
    error: str


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
handshake_decoder = msgspec.msgpack.Decoder(ReadyMessage | FailedMessage)
