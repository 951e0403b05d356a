"""Engine KV events on Kubernetes: every engine pod publishes them on a reachable address, declares their ports
on the container and the Service, and the CRD and the operator refuse the same port collisions
(docs/crd-reference.md; docs/contracts.md, "KV events")."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from crd_utils import admit
from isvc_utils import crd_schema, variant

from tandem_engine.entrypoints.cli import build_parser, config_from_args
from tandem_operator.args import config_hash, engine_command
from tandem_operator.naming import Component, engine_components
from tandem_operator.ports import MAX_RANKS
from tandem_operator.resources import build_config_map, build_engine_service
from tandem_operator.spec import MANAGED_ENGINE_FLAGS, InferenceServiceSpec, SpecError, parse_spec
from tandem_operator.workloads import build_engine_deployment

# Kubernetes' IANA_SVC_NAME: what a container or Service port name may be.
PORT_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def admitted(obj: dict[str, Any]) -> InferenceServiceSpec:
    """The spec as the API server stores it (defaults filled in), parsed by the operator."""
    defaulted, problems = admit(crd_schema(), obj)
    assert problems == []
    return parse_spec(defaulted)


def container_ports(spec: InferenceServiceSpec, role: Component) -> list[tuple[str, int]]:
    (container,) = build_engine_deployment(spec, role, "h")["spec"]["template"]["spec"]["containers"]
    return [(p["name"], p["containerPort"]) for p in container["ports"]]


def service_ports(spec: InferenceServiceSpec, role: Component) -> list[tuple[str, int]]:
    ports = build_engine_service(spec, role)["spec"]["ports"]
    assert all(p["targetPort"] == p["name"] for p in ports)
    return [(p["name"], p["port"]) for p in ports]


@pytest.mark.parametrize("example", ["disaggregated", "colocated"])
def test_every_engine_publishes_on_all_interfaces_by_default(example: str) -> None:
    spec = admitted(variant({}, example))
    for role in engine_components(spec.disaggregated):
        command = engine_command(spec, role)
        config = config_from_args(build_parser().parse_args(command[2:]))  # as `tandem serve` reads it
        assert (config.kv_events_port, config.kv_events_host) == (5557, "0.0.0.0")
        assert config.kv_events_buffer_steps == 10000 and config.data_parallel_size == 1
        assert "--kv-events-buffer-steps" not in command and "--data-parallel-size" not in command
        side = [("kv-side", 5600)] if spec.disaggregated else []
        want = [("http", 8000), *side, ("kv-events", 5557), ("kv-replay", 5558)]
        assert container_ports(spec, role) == service_ports(spec, role) == want


def test_settings_reach_the_engine_and_the_config_map() -> None:
    spec = admitted(variant({"spec.engine.kvEvents": {"port": 7000, "bufferSteps": 500},
                             "spec.engine.dataParallelSize": 2}))
    for role in (Component.PREFILL, Component.DECODE):
        config = config_from_args(build_parser().parse_args(engine_command(spec, role)[2:]))
        assert (config.kv_events_port, config.kv_events_buffer_steps, config.data_parallel_size) == (7000, 500, 2)
    doc = json.loads(build_config_map(spec)["data"]["engine-config.json"])
    assert doc["engine"]["kvEvents"] == {"port": 7000, "bufferSteps": 500}
    assert doc["engine"]["dataParallelSize"] == 2
    # A change of any of them rolls every engine pod (the hash is the pod template's annotation).
    base = config_hash(spec)
    for change in ({"spec.engine.kvEvents": {"port": 7002, "bufferSteps": 500}},
                   {"spec.engine.kvEvents": {"port": 7000}},
                   {"spec.engine.dataParallelSize": 3}):
        assert config_hash(admitted(variant({"spec.engine.kvEvents": {"port": 7000, "bufferSteps": 500},
                                             "spec.engine.dataParallelSize": 2, **change}))) != base


def test_port_zero_turns_kv_events_off() -> None:
    spec = admitted(variant({"spec.engine.kvEvents": {"port": 0}}, "colocated"))
    command = engine_command(spec, Component.DECODE)
    assert not [a for a in command if a.startswith("--kv-events")]
    assert config_from_args(build_parser().parse_args(command[2:])).kv_events_port == 0
    assert container_ports(spec, Component.DECODE) == service_ports(spec, Component.DECODE) == [("http", 8000)]


def test_each_data_parallel_rank_declares_its_ports() -> None:
    spec = admitted(variant({"spec.engine.dataParallelSize": 3}))
    want = [
        ("http", 8000),
        ("kv-side", 5600), ("kv-events", 5557), ("kv-replay", 5558),
        ("kv-side-1", 5601), ("kv-events-1", 5559), ("kv-replay-1", 5560),
        ("kv-side-2", 5602), ("kv-events-2", 5561), ("kv-replay-2", 5562),
    ]
    for role in (Component.PREFILL, Component.DECODE):
        assert container_ports(spec, role) == service_ports(spec, role) == want
    most = admitted(variant({"spec.engine.dataParallelSize": MAX_RANKS, "spec.engine.kvEvents": {"port": 20000}}))
    ports = container_ports(most, Component.DECODE)
    assert len(ports) == 1 + 3 * MAX_RANKS
    assert all(PORT_NAME.match(name) for name, _ in ports), [n for n, _ in ports if not PORT_NAME.match(n)]
    assert len({n for n, _ in ports}) == len({p for _, p in ports}) == len(ports)


def test_the_crd_allows_as_many_ranks_as_port_names_fit() -> None:
    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["dataParallelSize"]["maximum"] == MAX_RANKS
    assert not PORT_NAME.match(f"kv-replay-{MAX_RANKS * 100000}")  # the pattern does refuse long names


@pytest.mark.parametrize("flag", MANAGED_ENGINE_FLAGS)
@pytest.mark.parametrize("form", ["{flag}=1", "{flag}"])
def test_extra_args_cannot_set_a_managed_flag(flag: str, form: str) -> None:
    obj = variant({"spec.engine.extraArgs": ["--kv-cache-gib", "2", form.format(flag=flag)]})
    _, problems = admit(crd_schema(), obj)
    assert problems == [".spec.engine.extraArgs: extraArgs must not set flags rendered from typed fields"]
    with pytest.raises(SpecError, match=f"spec.engine.extraArgs: {flag} is set from typed fields"):
        parse_spec(obj)


# (change, a field both the CRD and the operator name when they refuse it). Rank i binds
# sideChannelPort + i, kvEvents.port + 2i and + 2i + 1; engine.port is 8000, sideChannelPort 5600.
REFUSED = {
    "events on http": ({"spec.engine.kvEvents": {"port": 8000}}, "kvEvents.port"),
    "replay on http": ({"spec.engine.kvEvents": {"port": 7999}}, "kvEvents.port"),
    "rank 1 on http": ({"spec.engine.kvEvents": {"port": 7997}, "spec.engine.dataParallelSize": 2},
                       "kvEvents.port"),
    "replay on side channel": ({"spec.engine.kvEvents": {"port": 5599}}, "kvEvents.port"),
    "side channel on events": ({"spec.kvTransfer.sideChannelPort": 5558}, "kvEvents.port"),
    "side channel rank 1 on events": ({"spec.kvTransfer.sideChannelPort": 5556, "spec.engine.dataParallelSize": 2},
                                      "kvEvents.port"),
    "side channel rank 1 on http": ({"spec.kvTransfer.sideChannelPort": 7999, "spec.engine.dataParallelSize": 2},
                                    "sideChannelPort"),
    "replay past 65535": ({"spec.engine.kvEvents": {"port": 65535}}, "kvEvents.port"),
    "rank 1 past 65535": ({"spec.engine.kvEvents": {"port": 65533}, "spec.engine.dataParallelSize": 2},
                          "kvEvents.port"),
    "side channel past 65535": ({"spec.kvTransfer.sideChannelPort": 65535, "spec.engine.dataParallelSize": 2},
                                "sideChannelPort"),
    "privileged port": ({"spec.engine.kvEvents": {"port": 80}}, "kvEvents.port"),
    "negative port": ({"spec.engine.kvEvents": {"port": -1}}, "port"),
    "too many ranks": ({"spec.engine.dataParallelSize": MAX_RANKS + 1}, "dataParallelSize"),
    "no ranks": ({"spec.engine.dataParallelSize": 0}, "dataParallelSize"),
    "empty buffer": ({"spec.engine.kvEvents": {"bufferSteps": 0}}, "bufferSteps"),
}
ADMITTED = {
    "below http": {"spec.engine.kvEvents": {"port": 7998}},
    "rank 1 ends below http": {"spec.engine.kvEvents": {"port": 7996}, "spec.engine.dataParallelSize": 2},
    "after side channel ranks": {"spec.engine.kvEvents": {"port": 5602}, "spec.engine.dataParallelSize": 2},
    "side channel right after events": {"spec.kvTransfer.sideChannelPort": 5559},
    "events off, any side channel": {"spec.engine.kvEvents": {"port": 0}, "spec.kvTransfer.sideChannelPort": 5557},
    "last ports": {"spec.engine.kvEvents": {"port": 65532}, "spec.engine.dataParallelSize": 2},
}


@pytest.mark.parametrize("change, needle", REFUSED.values(), ids=REFUSED.keys())
def test_crd_and_operator_refuse_the_same_ports(change: dict[str, Any], needle: str) -> None:
    obj = variant(change)
    _, problems = admit(crd_schema(), obj)
    assert any(needle in p for p in problems), problems
    with pytest.raises(SpecError) as info:
        parse_spec(obj)
    assert any(needle in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("change", ADMITTED.values(), ids=ADMITTED.keys())
def test_crd_and_operator_admit_the_same_ports(change: dict[str, Any]) -> None:
    spec = admitted(variant(change))
    assert parse_spec(variant(change)) == spec
