"""The CRD in crds/: a valid CustomResourceDefinition whose schema and CEL rules admit the examples,
refuse the invalid variants, and default exactly as the operator does."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from crd_utils import admit, all_rules, apply_defaults
from isvc_utils import CRD_PATH, EXAMPLES, crd_schema, load_yaml, variant

from tandem_operator import GROUP, KIND, PLURAL, VERSION
from tandem_operator.spec import ROUTER_POLICIES, parse_spec

K8S_VERSIONS = ("1.28", "1.37")


def test_crd_is_a_valid_custom_resource_definition() -> None:
    crd = load_yaml(CRD_PATH)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (
        GROUP,
        "Namespaced",
        KIND,
        PLURAL,
    )
    assert "isvc" not in spec["names"]["shortNames"]  # KServe's
    (v,) = spec["versions"]
    assert v["name"] == VERSION and v["served"] and v["storage"] and v["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert columns["Model"] == ".spec.model.uri"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Prefill", "Decode", "Router", "Age"} <= set(columns)
    assert len(all_rules(v["schema"])) >= 5


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_admitted(path: Any) -> None:
    obj = load_yaml(path)
    defaulted, problems = admit(crd_schema(), obj)
    assert problems == []
    parse_spec(defaulted)  # and the operator accepts them too


INVALID = {
    "negative replicas": ({"spec.decode.replicas": -1}, "decode.replicas"),
    "replicas not a number": ({"spec.router.replicas": "two"}, "router.replicas"),
    "unknown policy": ({"spec.router.policy": "Random"}, "policy"),
    "unknown connector": ({"spec.kvTransfer.connector": "Mooncake"}, "connector"),
    "block size": ({"spec.engine.blockSize": 17}, "blockSize"),
    "model uri": ({"spec.model.uri": "s3://bucket/model"}, "uri"),
    "no model": ({"spec.model": None}, "model"),
    "unknown field": ({"spec.engine.blocksize": 16}, "blocksize"),
    "prefill without connector": ({"spec.kvTransfer": None}, "KV connector"),
    "side channel on the http port": ({"spec.kvTransfer.sideChannelPort": 8000}, "sideChannelPort"),
    "managed flag in extraArgs": ({"spec.engine.extraArgs": ["--block-size=32"]}, "extraArgs"),
    "batch below seqs": ({"spec.engine.maxNumBatchedTokens": 8}, "maxNumBatchedTokens"),
    "name too long": ({"metadata.name": "x" * 41}, "40 characters"),
}


@pytest.mark.parametrize("change, needle", INVALID.values(), ids=INVALID.keys())
def test_invalid_variants_are_refused(change: dict[str, Any], needle: str) -> None:
    _, problems = admit(crd_schema(), variant(change))
    assert problems, "admitted"
    assert any(needle in p for p in problems), problems


def test_colocated_needs_no_connector() -> None:
    obj = variant({"spec.kvTransfer": None, "spec.prefill.enabled": False})
    assert admit(crd_schema(), obj)[1] == []
    obj = variant({"spec.kvTransfer": None, "spec.prefill": None})
    assert admit(crd_schema(), obj)[1] == []


def test_operator_defaults_equal_crd_defaults() -> None:
    """A minimal object parsed by the operator as-is equals the same object defaulted by the CRD."""
    minimal = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {"model": {"uri": "/models/x"}, "prefill": {}, "kvTransfer": {"connector": "NixlConnector"}},
    }
    defaulted = apply_defaults(crd_schema(), copy.deepcopy(minimal))
    assert defaulted["spec"]["engine"]["blockSize"] == 16  # defaulting did run
    assert parse_spec(minimal) == parse_spec(defaulted)


def test_policy_enum_matches_the_router_cli() -> None:
    schema = crd_schema()
    enum = schema["properties"]["spec"]["properties"]["router"]["properties"]["policy"]["enum"]
    assert set(enum) == set(ROUTER_POLICIES)
    assert set(ROUTER_POLICIES.values()) == {"round-robin", "least-load", "prefix-aware", "session-affinity"}
