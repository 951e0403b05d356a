"""Command lines of the engine (`tandem serve`) and router (`tandem route`), rendered from the spec.

Prefill and decode get their flags from one function: everything that must match between the two
roles (model, dtype, block size, max model length, scheduler limits, side-channel port) comes from
the same typed fields, and only `--role` differs. Every engine publishes KV events on all its
interfaces, so that routers in other pods can subscribe (docs/contracts.md, "KV events"). The shared
settings are also written to the engine ConfigMap, whose hash rolls every engine pod when one of
them changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from tandem_operator.naming import LABEL_ISVC, Component, engine_components, service_host
from tandem_operator.ports import EnginePorts
from tandem_operator.spec import ROUTER_POLICIES, InferenceServiceSpec

MODEL_DIR = "/models"


def model_path(spec: InferenceServiceSpec) -> str:
    """What the engine's `--model` gets: a path inside the pod, or the alias as is."""
    uri = spec.model.uri
    if uri.startswith("pvc://"):
        _, _, sub = uri.removeprefix("pvc://").partition("/")
        return f"{MODEL_DIR}/{sub}".rstrip("/")
    if uri.startswith("hf://"):
        return f"{MODEL_DIR}/{uri.removeprefix('hf://')}"
    return uri


def engine_role_flag(spec: InferenceServiceSpec, role: Component) -> str:
    if not spec.disaggregated:
        return "both"
    return "prefill" if role is Component.PREFILL else "decode"


def shared_engine_args(spec: InferenceServiceSpec) -> list[str]:
    """The flags prefill and decode must agree on, in a fixed order."""
    e = spec.engine
    args = [
        "--model",
        model_path(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(e.port),
        "--dtype",
        e.dtype,
        "--max-model-len",
        str(e.max_model_len),
        "--block-size",
        str(e.block_size),
        # The router forwards a client's `priority`; equal priorities are served first come, first served.
        "--scheduling-policy",
        "priority",
    ]
    if e.max_num_seqs is not None:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.data_parallel_size > 1:
        args += ["--data-parallel-size", str(e.data_parallel_size)]
    if spec.disaggregated and spec.kv_transfer is not None:
        args += ["--kv-connector", spec.kv_transfer.connector,
                 "--kv-side-channel-port", str(spec.kv_transfer.side_channel_port)]
    if e.kv_events.port:
        args += ["--kv-events-port", str(e.kv_events.port), "--kv-events-host", "0.0.0.0"]
        if e.kv_events.buffer_steps is not None:
            args += ["--kv-events-buffer-steps", str(e.kv_events.buffer_steps)]
    return args


def engine_ports(spec: InferenceServiceSpec) -> EnginePorts:
    """The ports the engine pods bind (the side channel only where there is KV transfer)."""
    kv = spec.kv_transfer
    side_channel = kv.side_channel_port if spec.disaggregated and kv is not None else None
    return EnginePorts(spec.engine.port, side_channel, spec.engine.kv_events.port, spec.engine.data_parallel_size)


def engine_command(spec: InferenceServiceSpec, role: Component, per_pod: Sequence[str] = ()) -> list[str]:
    """The engine's command line; `per_pod` (flags outside the shared configuration) goes before the user's
    extraArgs, which may override any flag."""
    # Decode engines reach a prefill engine's side channel at the address it advertises in
    # kv_transfer_params: the pod's own IP (the kubelet expands $(POD_IP) from the container's env).
    kv_host = ["--kv-host", "$(POD_IP)"] if spec.disaggregated else []
    return [
        "tandem",
        "serve",
        *shared_engine_args(spec),
        "--role",
        engine_role_flag(spec, role),
        *kv_host,
        *per_pod,
        *spec.engine.extra_args,
    ]


def router_command(spec: InferenceServiceSpec) -> list[str]:
    r = spec.router
    port = spec.engine.port
    decode = f"http://{service_host(spec.name, spec.namespace, Component.DECODE)}:{port}"
    args = ["tandem", "route", "--host", "0.0.0.0", "--port", str(r.port), "--decode", decode]
    if spec.disaggregated:
        args += ["--prefill", f"http://{service_host(spec.name, spec.namespace, Component.PREFILL)}:{port}"]
    args += ["--policy", ROUTER_POLICIES[r.policy]]
    if r.discovery == "Kubernetes":
        # The router adds the role label itself, per pool.
        args += [
            "--discovery",
            "kubernetes",
            "--namespace",
            spec.namespace,
            "--selector",
            f"{LABEL_ISVC}={spec.name}",
        ]
    else:
        args += ["--discovery", "static"]
    a = spec.autoscaling
    hold = [a.hold_seconds] if a is not None and a.scale_to_zero else []
    if spec.rollout.strategy == "DrainFirst":
        hold.append(spec.rollout.hold_seconds)
    if hold:
        # At zero (scale to zero, or a DrainFirst roll of one-pod roles) the router holds requests until a
        # decode engine is Ready again: docs/operations.md.
        args += ["--cold-start-timeout", str(max(hold))]
    return args


def engine_config(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The rendered engine configuration shared by every engine pod of the service."""
    e = spec.engine
    kv = spec.kv_transfer
    return {
        "model": {
            "uri": spec.model.uri,
            "path": model_path(spec),
            "servedName": spec.model.served_name,
            "revision": spec.model.revision,
        },
        "engine": {
            "dtype": e.dtype,
            "blockSize": e.block_size,
            "maxModelLen": e.max_model_len,
            "maxNumSeqs": e.max_num_seqs,
            "maxNumBatchedTokens": e.max_num_batched_tokens,
            "port": e.port,
            "dataParallelSize": e.data_parallel_size,
            "kvEvents": {"port": e.kv_events.port, "bufferSteps": e.kv_events.buffer_steps},
            "extraArgs": list(e.extra_args),
        },
        "kvTransfer": None
        if kv is None or not spec.disaggregated
        else {
            "connector": kv.connector,
            "sideChannelPort": kv.side_channel_port,
            "ucxTransports": kv.ucx_transports,
            "ucxNetDevices": kv.ucx_net_devices,
        },
        "mode": "disaggregated" if spec.disaggregated else "colocated",
        "args": {role.value: engine_command(spec, role) for role in engine_components(spec.disaggregated)},
    }


def config_json(spec: InferenceServiceSpec) -> str:
    return json.dumps(engine_config(spec), indent=2, sort_keys=True)


def config_hash(spec: InferenceServiceSpec) -> str:
    return hashlib.sha256(config_json(spec).encode()).hexdigest()[:16]


def engine_revision(spec: InferenceServiceSpec, digest: str) -> str:
    """What a prefill and a decode engine must share to move KV between them: the shared configuration (its
    hash) and the image. The router pairs engines of one revision only (docs/operations.md, "Upgrades")."""
    return hashlib.sha256(f"{digest}/{spec.engine.image}".encode()).hexdigest()[:12]
