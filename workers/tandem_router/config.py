"""Router settings: one dataclass, filled by `tandem route` flags or by tests directly."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    decode_urls: list[str] = field(default_factory=list)  # decode or colocated engines
    prefill_urls: list[str] = field(default_factory=list)
    decode_policy: str = "least-load"
    prefill_policy: str = "least-load"
    discovery: str = "static"  # static | kubernetes
    namespace: str = "default"
    decode_selector: str = ""
    prefill_selector: str = ""
    port_name: str = "http"  # the EndpointSlice port to use; else the slice's only port, else target_port
    target_port: int = 8000
    kubeconfig: str | None = None
    api_key: str | None = None
    session_header: str = "x-session-id"
    # Remote prefill is skipped when the decode endpoint's uncached part of the prompt is this short.
    remote_prefill_threshold: int = 32
    block_chars: int = 64  # prefix-index block: ~16 tokens
    max_blocks: int = 256
    index_capacity_blocks: int = 32768  # per endpoint
    load_factor: float = 1.25  # bounded-prefix and session-affinity
    cold_key_blocks: int = 8
    # prefix-aware scoring (policies.ScoreWeights; docs/operations.md, "Routing")
    prefix_weight: float = 3.0
    queue_weight: float = 1.0
    kv_usage_weight: float = 1.0
    min_prefix_fraction: float = 0.1
    cold_queue_slack: int = 0
    kv_events: bool = True  # follow engines' KV events into the exact index when they publish them
    max_attempts: int = 3  # tries per request, on different endpoints, before the first byte only
    max_migrations: int = 2  # a broken stream resumed on another engine at most this often (0: never)
    # Overload control (admission.py; docs/operations.md, "Overload").
    admission_control: bool = True
    max_in_flight_per_endpoint: int = 0  # 0: the engine's tandem:engine_max_num_seqs, else 64
    max_queued_requests: int = 256  # waiting for a slot, over all endpoints; beyond: 429
    queue_timeout: float = 30.0  # seconds a request waits for a slot before its 429
    # Seconds a request waits for a decode endpoint to exist before its 503 (docs/operations.md,
    # "Scale from zero"); 0: no engine means an immediate 503.
    cold_start_timeout: float = 0.0
    connect_timeout: float = 3.0
    read_timeout: float = 120.0  # longest silence from an upstream, headers or body
    request_timeout: float = 1800.0
    health_interval: float = 2.0  # 0 disables active health checks
    load_interval: float = 0.25  # prefix-aware: seconds between scrapes of engine load; 0: with health checks
    health_timeout: float = 2.0
    health_failures: int = 2  # consecutive failed checks that eject an endpoint
