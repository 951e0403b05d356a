"""The typed `InferenceService` spec: defaults and the checks the CRD schema also makes.

A real apiserver applies the CRD's defaults and rejects what its schema and CEL rules reject; this
module repeats both so that the operator stays correct against servers that do neither (an old
object stored before a schema change, a test server) and reports an invalid spec as a condition
instead of failing on it. `tests/operator` checks that these defaults equal the CRD's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tandem_operator.autoscaling.spec import AutoscalingSpec, parse_autoscaling
from tandem_operator.naming import MAX_NAME_LENGTH
from tandem_operator.ports import MAX_RANKS, EnginePorts

DEFAULT_IMAGE = "ghcr.io/tandem-dev/tandem-worker:0.1.0"
DTYPES = ("auto", "float32", "bfloat16")
BLOCK_SIZES = (8, 16, 32, 64, 128)
PULL_POLICIES = ("IfNotPresent", "Always", "Never")
CONNECTORS = ("NixlConnector",)
# CRD enum (Kubernetes CamelCase) -> `tandem route --policy` value.
ROUTER_POLICIES = {
    "RoundRobin": "round-robin",
    "LeastLoad": "least-load",
    "PrefixAware": "prefix-aware",
    "SessionAffinity": "session-affinity",
}
DISCOVERY = ("Kubernetes", "Static")
ROLLOUT_STRATEGIES = ("Surge", "DrainFirst")
PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")  # a NetworkPolicyPeer's fields
DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's
# Flags the operator renders from typed fields; `engine.extraArgs` must not repeat them, or prefill
# and decode could be made to disagree on what has to match.
MANAGED_ENGINE_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--dtype",
    "--role",
    "--max-model-len",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--kv-connector",
    "--kv-side-channel-port",
    "--data-parallel-size",
    "--kv-events-port",
    "--kv-events-host",
    "--kv-events-buffer-steps",
    "--revision",
    "--drain-seconds",
)
MODEL_URI = re.compile(
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hf://[^/\s]+/[^/\s]+|/\S*|[a-z0-9][a-z0-9.-]*)$"
)


class SpecError(ValueError):
    """The spec is invalid; `problems` lists every reason, field path first."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    served_name: str
    revision: str | None
    auth_secret_name: str | None


@dataclass(frozen=True)
class KVEventsSpec:
    port: int  # 0: the engines publish no KV events
    buffer_steps: int | None


@dataclass(frozen=True)
class EngineSpec:
    image: str
    image_pull_policy: str
    dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    port: int
    data_parallel_size: int
    kv_events: KVEventsSpec
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class KVTransferSpec:
    connector: str
    side_channel_port: int
    ucx_transports: str | None
    ucx_net_devices: str | None


@dataclass(frozen=True)
class RoleSpec:
    enabled: bool
    replicas: int
    resources: dict[str, Any]
    pod_template: dict[str, Any]
    startup_seconds: int
    drain_seconds: int


@dataclass(frozen=True)
class RouterSpec:
    replicas: int
    image: str
    policy: str
    discovery: str
    port: int
    resources: dict[str, Any]
    pod_template: dict[str, Any]
    auth_secret: tuple[str, str] | None = None  # (Secret name, key) holding the router's API key


@dataclass(frozen=True)
class RolloutSpec:
    strategy: str  # "Surge": new pod Ready before an old one drains; "DrainFirst": the other way round
    hold_seconds: int  # DrainFirst: how long the router holds a request while no decode engine is Ready


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool
    metrics_from: tuple[dict[str, Any], ...]  # NetworkPolicyPeers allowed on the engines' HTTP port


@dataclass(frozen=True)
class InferenceServiceSpec:
    name: str
    namespace: str
    model: ModelSpec
    engine: EngineSpec
    kv_transfer: KVTransferSpec | None
    prefill: RoleSpec
    decode: RoleSpec
    router: RouterSpec
    autoscaling: AutoscalingSpec | None = None  # None: fixed replicas
    rollout: RolloutSpec = RolloutSpec("Surge", 300)
    network_policy: NetworkPolicySpec = NetworkPolicySpec(True, ())

    @property
    def disaggregated(self) -> bool:
        return self.prefill.enabled


class SpecReader:
    """Reads typed fields out of a plain dict, collecting every problem instead of stopping at one."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def section(self, parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
        value = parent.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{path}.{key}: must be an object")
            return {}
        return value

    def integer(
        self,
        obj: dict[str, Any],
        key: str,
        path: str,
        default: int | None,
        minimum: int | None = None,
        maximum: int | None = None,
        choices: tuple[int, ...] | None = None,
    ) -> int | None:
        value = obj.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{path}.{key}: must be an integer, got {value!r}")
            return default
        if minimum is not None and value < minimum:
            self.problems.append(f"{path}.{key}: must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            self.problems.append(f"{path}.{key}: must be <= {maximum}, got {value}")
        if choices is not None and value not in choices:
            self.problems.append(f"{path}.{key}: must be one of {list(choices)}, got {value}")
        return value

    def required_int(self, obj: dict[str, Any], key: str, path: str, default: int, **limits: Any) -> int:
        value = self.integer(obj, key, path, default, **limits)
        return default if value is None else value

    def string(
        self,
        obj: dict[str, Any],
        key: str,
        path: str,
        default: str | None,
        choices: tuple[str, ...] | None = None,
    ) -> str | None:
        value = obj.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            self.problems.append(f"{path}.{key}: must be a string, got {value!r}")
            return default
        if choices is not None and value not in choices:
            self.problems.append(f"{path}.{key}: unsupported value {value!r}, must be one of {list(choices)}")
        return value

    def boolean(self, obj: dict[str, Any], key: str, path: str, default: bool) -> bool:
        value = obj.get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{path}.{key}: must be a boolean, got {value!r}")
            return default
        return value

    def mapping(self, obj: dict[str, Any], key: str, path: str) -> dict[str, Any]:
        return self.section(obj, key, path)

    def strings(self, obj: dict[str, Any], key: str, path: str) -> tuple[str, ...]:
        value = obj.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.problems.append(f"{path}.{key}: must be a list of strings")
            return ()
        return tuple(value)


def _quantities(resources: dict[str, Any]) -> dict[str, Any]:
    """Write quantities as the apiserver returns them (`1` -> `"1"`), so a reconcile that compares
    the desired Deployment with the live one does not see a difference that is not there."""
    out: dict[str, Any] = {}
    for section, value in resources.items():
        if isinstance(value, dict):
            out[section] = {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                for k, v in value.items()
            }
        else:
            out[section] = value
    return out


def served_name_for(uri: str) -> str:
    """The model id clients use when `servedName` is not set: the URI's last path element."""
    tail = uri.rstrip("/").rsplit("/", 1)[-1]
    return tail.removesuffix(".gguf") or uri


def parse_spec(body: dict[str, Any]) -> InferenceServiceSpec:
    """Parse an `InferenceService` object (as a dict) into a typed spec or raise `SpecError`."""
    r = SpecReader()
    meta = body.get("metadata") or {}
    name = str(meta.get("name", ""))
    namespace = str(meta.get("namespace") or "default")
    if len(name) > MAX_NAME_LENGTH:
        r.problems.append(f"metadata.name: must be at most {MAX_NAME_LENGTH} characters")
    spec = body.get("spec")
    if not isinstance(spec, dict):
        raise SpecError(["spec: is required"])

    model = _model(r, r.section(spec, "model", "spec"))
    engine = _engine(r, r.section(spec, "engine", "spec"))
    kv = _kv_transfer(r, spec)
    prefill_raw = spec.get("prefill")
    prefill = _role(
        r, r.section(spec, "prefill", "spec"), "spec.prefill", enabled_default=prefill_raw is not None
    )
    decode = _role(r, r.section(spec, "decode", "spec"), "spec.decode", enabled_default=True)
    router = _router(r, r.section(spec, "router", "spec"), engine.image)
    autoscaling = parse_autoscaling(r, spec, prefill.enabled)
    rollout = _rollout(r, r.section(spec, "rollout", "spec"))
    network_policy = _network_policy(r, r.section(spec, "networkPolicy", "spec"))

    if prefill.enabled and kv is None:
        r.problems.append("spec.kvTransfer: a KV connector is required when prefill is enabled")
    r.problems += EnginePorts(
        engine.port, None if kv is None else kv.side_channel_port, engine.kv_events.port, engine.data_parallel_size
    ).problems()
    if (
        engine.max_num_seqs is not None
        and engine.max_num_batched_tokens is not None
        and engine.max_num_batched_tokens < engine.max_num_seqs
    ):
        r.problems.append("spec.engine.maxNumBatchedTokens: must be >= spec.engine.maxNumSeqs")
    if r.problems:
        raise SpecError(r.problems)
    return InferenceServiceSpec(
        name=name,
        namespace=namespace,
        model=model,
        engine=engine,
        kv_transfer=kv,
        prefill=prefill,
        decode=decode,
        router=router,
        autoscaling=autoscaling,
        rollout=rollout,
        network_policy=network_policy,
    )


def _model(r: SpecReader, raw: dict[str, Any]) -> ModelSpec:
    uri = r.string(raw, "uri", "spec.model", None)
    if not uri:
        r.problems.append("spec.model.uri: is required")
        uri = ""
    elif not MODEL_URI.match(uri):
        r.problems.append(f"spec.model.uri: {uri!r} is not a pvc://, hf:// URI, an absolute path or an alias")
    served = r.string(raw, "servedName", "spec.model", None) or served_name_for(uri)
    return ModelSpec(
        uri=uri,
        served_name=served,
        revision=r.string(raw, "revision", "spec.model", None),
        auth_secret_name=r.string(raw, "authSecretName", "spec.model", None),
    )


def _engine(r: SpecReader, raw: dict[str, Any]) -> EngineSpec:
    p = "spec.engine"
    extra = r.strings(raw, "extraArgs", p)
    for arg in extra:
        if arg.split("=", 1)[0] in MANAGED_ENGINE_FLAGS:
            r.problems.append(
                f"{p}.extraArgs: {arg.split('=', 1)[0]} is set from typed fields, not extraArgs"
            )
    env = raw.get("env") or []
    if not isinstance(env, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) for e in env
    ):
        r.problems.append(f"{p}.env: must be a list of {{name, value | valueFrom}}")
        env = []
    return EngineSpec(
        image=r.string(raw, "image", p, DEFAULT_IMAGE) or DEFAULT_IMAGE,
        image_pull_policy=r.string(raw, "imagePullPolicy", p, "IfNotPresent", PULL_POLICIES)
        or "IfNotPresent",
        dtype=r.string(raw, "dtype", p, "auto", DTYPES) or "auto",
        block_size=r.required_int(raw, "blockSize", p, 16, choices=BLOCK_SIZES),
        max_model_len=r.required_int(raw, "maxModelLen", p, 2048, minimum=16, maximum=1048576),
        max_num_seqs=r.integer(raw, "maxNumSeqs", p, None, minimum=1, maximum=4096),
        max_num_batched_tokens=r.integer(raw, "maxNumBatchedTokens", p, None, minimum=1),
        port=r.required_int(raw, "port", p, 8000, minimum=1024, maximum=65535),
        data_parallel_size=r.required_int(raw, "dataParallelSize", p, 1, minimum=1, maximum=MAX_RANKS),
        kv_events=_kv_events(r, r.section(raw, "kvEvents", p)),
        extra_args=extra,
        env=tuple(env),
    )


def _kv_events(r: SpecReader, raw: dict[str, Any]) -> KVEventsSpec:
    p = "spec.engine.kvEvents"
    port = r.required_int(raw, "port", p, DEFAULT_KV_EVENTS_PORT, minimum=0, maximum=65535)
    if 0 < port < 1024:
        r.problems.append(f"{p}.port: must be 0 (off) or 1024 to 65535, got {port}")
    return KVEventsSpec(
        port=port, buffer_steps=r.integer(raw, "bufferSteps", p, None, minimum=1, maximum=1_000_000)
    )


def _kv_transfer(r: SpecReader, spec: dict[str, Any]) -> KVTransferSpec | None:
    if spec.get("kvTransfer") is None:
        return None
    raw = r.section(spec, "kvTransfer", "spec")
    p = "spec.kvTransfer"
    connector = r.string(raw, "connector", p, None, CONNECTORS)
    if connector is None:
        r.problems.append(f"{p}.connector: is required")
    ucx = r.section(raw, "ucx", p)
    return KVTransferSpec(
        connector=connector or "",
        side_channel_port=r.required_int(raw, "sideChannelPort", p, 5600, minimum=1024, maximum=65535),
        ucx_transports=r.string(ucx, "transports", f"{p}.ucx", None),
        ucx_net_devices=r.string(ucx, "netDevices", f"{p}.ucx", None),
    )


def _role(r: SpecReader, raw: dict[str, Any], p: str, enabled_default: bool) -> RoleSpec:
    startup = r.section(raw, "startup", p)
    return RoleSpec(
        enabled=r.boolean(raw, "enabled", p, enabled_default) if "prefill" in p else True,
        replicas=r.required_int(raw, "replicas", p, 1, minimum=0, maximum=1000),
        resources=_quantities(r.mapping(raw, "resources", p)),
        pod_template=r.mapping(raw, "podTemplate", p),
        startup_seconds=r.required_int(
            startup, "maxSeconds", f"{p}.startup", 1800, minimum=10, maximum=86400
        ),
        drain_seconds=r.required_int(raw, "drainSeconds", p, 30, minimum=0, maximum=3600),
    )


def _router(r: SpecReader, raw: dict[str, Any], engine_image: str) -> RouterSpec:
    p = "spec.router"
    auth = r.section(raw, "auth", p)
    secret = r.string(auth, "secretName", f"{p}.auth", None) if auth else None
    if auth and not secret:
        r.problems.append(f"{p}.auth.secretName: required")
    return RouterSpec(
        replicas=r.required_int(raw, "replicas", p, 1, minimum=0, maximum=100),
        image=r.string(raw, "image", p, None) or engine_image,
        policy=r.string(raw, "policy", p, "RoundRobin", tuple(ROUTER_POLICIES)) or "RoundRobin",
        discovery=r.string(raw, "discovery", p, "Kubernetes", DISCOVERY) or "Kubernetes",
        port=r.required_int(raw, "port", p, 8000, minimum=1024, maximum=65535),
        resources=_quantities(r.mapping(raw, "resources", p)),
        pod_template=r.mapping(raw, "podTemplate", p),
        auth_secret=(secret, r.string(auth, "secretKey", f"{p}.auth", "api-key") or "api-key") if secret else None,
    )


def _rollout(r: SpecReader, raw: dict[str, Any]) -> RolloutSpec:
    p = "spec.rollout"
    return RolloutSpec(
        strategy=r.string(raw, "strategy", p, "Surge", ROLLOUT_STRATEGIES) or "Surge",
        hold_seconds=r.required_int(raw, "holdSeconds", p, 300, minimum=1, maximum=3600),
    )


def _network_policy(r: SpecReader, raw: dict[str, Any]) -> NetworkPolicySpec:
    p = "spec.networkPolicy"
    peers = raw.get("metricsFrom") or []
    if not isinstance(peers, list) or not all(
        isinstance(peer, dict) and peer and set(peer) <= set(PEER_KEYS) for peer in peers
    ):
        r.problems.append(f"{p}.metricsFrom: must be a list of NetworkPolicyPeers ({', '.join(PEER_KEYS)})")
        peers = []
    return NetworkPolicySpec(enabled=r.boolean(raw, "enabled", p, True), metrics_from=tuple(peers))
