"""One engine config, built from `tandem serve` flags and handed whole to every EngineCore process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tandem_engine.cpu_budget import ThreadPlan, plan_threads

Role = Literal["both", "prefill", "decode"]


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None
    dtype: str = "auto"
    role: Role = "both"
    # Model limits; None means "from the model's config".
    max_model_len: int | None = None
    # Cache
    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gib (tests use it to force preemption)
    enable_prefix_caching: bool = True
    # Scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Parallel
    data_parallel_size: int = 1
    num_threads: int | None = None  # torch threads per EngineCore; None: the CPUs we may use / DP size
    # KV transfer (P/D)
    kv_side_channel_port: int = 5600
    kv_host: str = "127.0.0.1"
    kv_lease_seconds: float = 30.0
    kv_failure_policy: Literal["fail", "recompute"] = "fail"
    kv_transfer_threads: int = 2  # UCX threads that split one READ into parallel copies (0: none)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # Start-up
    ready_timeout_s: float = 600.0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    def thread_plan(self) -> ThreadPlan:
        """Intra-op threads per EngineCore, from the CPUs this process may use (docs/operations.md)."""
        return plan_threads(self.data_parallel_size, self.num_threads)
