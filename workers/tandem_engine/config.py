"""One engine config, built from `tandem serve` flags and handed whole to every EngineCore process.

Its defaults are the flags' defaults (`tandem serve --help` shows them); two of them may come from the
environment, where the operator and tests set them.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tandem_engine.cpu_budget import ThreadPlan, plan_threads

EngineRole = Literal["both", "prefill", "decode"]  # colocated, or one side of P/D
DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16"]  # vLLM's values; auto: the model's dtype
KVFailurePolicy = Literal["fail", "recompute"]
KVConnectorName = Literal["NixlConnector"]  # the one connector today; the CRD names it too
AttentionBackendName = Literal["auto", "torch", "triton"]
SchedulingPolicy = Literal["fcfs", "priority"]  # vLLM's: arrival order, or (priority, arrival)
# vLLM's --quantization: none keeps the dense weights; int8 runs the projections as dynamic W8A8 matmuls
# with float32 activations around them; gguf serves a GGUF file's own Q4_1/Q8_0 blocks through a C kernel
# (docs/architecture.md, "Quantization" and "GGUF weight-only quantization").
Quantization = Literal["none", "int8", "gguf"]

SERVED_MODEL_NAME_ENV = "TANDEM_SERVED_MODEL_NAME"  # set by the operator on every engine pod
CACHE_DIR_ENV = "TANDEM_CACHE_DIR"
# The default step token budget (--max-num-batched-tokens) by device: EngineConfig.step_token_budget.
CPU_STEP_TOKENS = 512
GPU_STEP_TOKENS = 2048


def default_cache_dir() -> str:
    """Where dequantized GGUF models and the built CPU attention kernel are kept."""
    return os.environ.get(CACHE_DIR_ENV) or "~/.cache/tandem"


def build_dir(cache_dir: Path) -> Path:
    """Where to build what `cache_dir` lacks: `cache_dir` itself, or, when it is read-only (a cache baked
    into an image, docs/operations.md), a directory under the system's temp dir. Look-ups try `cache_dir`
    first, then this."""
    probe = cache_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if os.access(probe, os.W_OK):
        return cache_dir
    return Path(tempfile.gettempdir()) / f"tandem-cache-{os.getuid()}"


def _served_model_name_from_env() -> str | None:
    return os.environ.get(SERVED_MODEL_NAME_ENV) or None


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = field(default_factory=_served_model_name_from_env)
    dtype: DType = "auto"
    role: EngineRole = "both"
    # Model limits; None means "from the model's config".
    max_model_len: int | None = None
    # Cache
    block_size: int = 16
    kv_cache_dtype: KVCacheDType = "auto"  # what the cache stores; attention computes in the model's dtype
    kv_cache_gib: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gib (tests use it to force preemption)
    enable_prefix_caching: bool = True
    # Scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: step_token_budget's device default
    scheduling_policy: SchedulingPolicy = "fcfs"
    # The tool-call format (entrypoints/tools.py): auto, smollm2 or hermes.
    tool_call_parser: str = "auto"
    # The API server answers 429 rather than let more requests than this wait for a free running slot
    # (docs/operations.md, "Overload: priorities and the waiting bound").
    max_waiting_requests: int = 1024
    # Parallel
    data_parallel_size: int = 1
    num_threads: int | None = None  # torch threads per EngineCore; None: the CPUs we may use / DP size
    # KV transfer (P/D)
    kv_connector: KVConnectorName = "NixlConnector"
    kv_side_channel_port: int = 5600
    kv_host: str = "127.0.0.1"
    kv_lease_seconds: float = 30.0
    kv_failure_policy: KVFailurePolicy = "fail"
    kv_transfer_threads: int = 2  # UCX threads that split one READ into parallel copies (0: none)
    # KV events for routers (docs/contracts.md, "KV events"); 0: none. DP rank i publishes on
    # kv_events_port + 2i and answers replay requests on kv_events_port + 2i + 1.
    kv_events_port: int = 0
    kv_events_host: str = "127.0.0.1"
    kv_events_buffer_steps: int = 10000
    # Compute
    attention_backend: AttentionBackendName = "auto"
    cpu_attention_kernel: bool = True  # the torch backend's C attention kernels (decode, prefill), where they build
    cpu_fused_kernels: bool = True  # C kernels for residual add + RMSNorm, SiLU * up and RoPE (kernels/fused.py)
    onednn_pack: bool = True  # oneDNN-prepacked weights for batched CPU matmuls (models/packed_linear.py)
    # float32 matmuls of 32 rows or more on AMX over a GGUF file's blocks, where the CPU has AMX
    # (kernels/amx_matmul.py)
    cpu_amx_float32: bool = True
    # on the AVX2 build of the panel kernel, float panels beside a GGUF file's blocks for matmuls of 16 rows or
    # more (kernels/panel_matmul.py, FLOAT_PANELS_FROM_ROWS): faster batches for 4 more bytes a weight
    cpu_float_panels: bool = True
    quantization: Quantization = "none"  # weight quantization of the projections (models/quantization.py)
    cache_dir: str = field(default_factory=default_cache_dir)
    # What a prefill and a decode engine must share to move KV between them (set by the operator: the shared
    # configuration's hash and the image); /health reports it and routers pair engines by it. "": none given.
    revision: str = ""
    # Start-up and shutdown
    ready_timeout_s: float = 600.0
    # After SIGTERM: how long requests in flight, and a prefill engine's leases on blocks decode engines have
    # yet to read, may keep the engine up; what is still open then is aborted (docs/operations.md)
    drain_seconds: int = 30

    @property
    def max_running_requests(self) -> int:
        """Requests all EngineCores behind this API server can run at once."""
        return self.max_num_seqs * self.data_parallel_size

    def kv_events_ports(self, rank: int) -> tuple[int, int]:
        """The PUB and replay ports of data-parallel rank `rank` (kv_events_port must be set)."""
        port = self.kv_events_port + 2 * rank
        return port, port + 1

    def kv_events_info(self) -> dict[str, object]:
        """What `GET /kv_events` answers: where each EngineCore publishes (docs/contracts.md, "KV events")."""
        publishers = [] if not self.kv_events_port else [
            {"rank": r, "host": self.kv_events_host, "port": p, "replay_port": rp}
            for r in range(self.data_parallel_size) for p, rp in [self.kv_events_ports(r)]]
        return {"block_size": self.block_size, "publishers": publishers}

    def quantization_error(self) -> str | None:
        """Why --quantization cannot work with the other flags, or None. int8 and gguf compute in float32
        (`--dtype auto` becomes float32 there); a GPU is refused by the engine at load time, and whether
        --model is a GGUF gguf can serve is checked by `tandem serve` (entrypoints/cli.py)."""
        if self.quantization in ("int8", "gguf") and self.dtype not in ("auto", "float32"):
            return (f"--quantization {self.quantization} needs float32 activations around its matmuls: use "
                    f"--dtype float32 or auto, not --dtype {self.dtype}")
        return None

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()

    def step_token_budget(self, device: str) -> int:
        """Tokens one step may compute on `device` ("cpu" or "cuda"): --max-num-batched-tokens if given, else
        a budget that keeps a step short there, never below max_num_seqs (every running request decodes
        in each step). A 2048-token chunk takes ~2.3 s on 2 CPUs, and every running stream waits it out;
        512 keeps that wait to ~0.6 s at the same batched throughput (docs/operations.md, "Scheduling")."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(CPU_STEP_TOKENS if device == "cpu" else GPU_STEP_TOKENS, self.max_num_seqs)

    def thread_plan(self) -> ThreadPlan:
        """Intra-op threads per EngineCore, from the CPUs this process may use (docs/operations.md)."""
        return plan_threads(self.data_parallel_size, self.num_threads)
