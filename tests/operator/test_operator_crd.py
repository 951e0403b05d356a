"""The CRD in crds/: a valid CustomResourceDefinition whose schema and CEL rules admit the examples,
refuse the invalid variants, and default exactly as the operator does."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from crd_utils import admit, all_rules, apply_defaults
from isvc_utils import AUTOSCALED, CRD_PATH, EXAMPLES, INVALID, crd_schema, load_yaml, variant

from tandem_operator import GROUP, KIND, PLURAL, VERSION
from tandem_operator.spec import ROUTER_POLICIES, SpecError, parse_spec

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
    assert v["name"] == VERSION and v["served"] and v["storage"]
    # `kubectl scale`, HPA and KEDA move the decode pool; they find its pods by status.decode.selector.
    assert v["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.decode.replicas",
                                                         "statusReplicasPath": ".status.decode.replicas",
                                                         "labelSelectorPath": ".status.decode.selector"}}
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


@pytest.mark.parametrize("change, needle", INVALID.values(), ids=INVALID.keys())
def test_invalid_variants_are_refused(change: dict[str, Any], needle: str) -> None:
    _, problems = admit(crd_schema(), variant(change))
    assert problems, "admitted"
    assert any(needle in p for p in problems), problems
    # and the operator refuses it too, for a server that did not validate it
    if "autoscaling" in next(iter(change)):
        with pytest.raises(SpecError):
            parse_spec(variant(change))


def test_autoscaling_prefill_bounds_need_a_prefill_pool() -> None:
    colocated = {"spec.kvTransfer": None, "spec.prefill": None}
    _, problems = admit(crd_schema(), variant({**colocated, "spec.autoscaling": AUTOSCALED}))
    assert any("needs a disaggregated service" in p for p in problems), problems
    with pytest.raises(SpecError, match="only a disaggregated service"):
        parse_spec(variant({**colocated, "spec.autoscaling": AUTOSCALED}))
    decode_only = {"decode": {"minReplicas": 0, "maxReplicas": 3}, "scaleToZero": {"idleSeconds": 60}}
    defaulted, problems = admit(crd_schema(), variant({**colocated, "spec.autoscaling": decode_only}))
    assert problems == []
    scaling = parse_spec(defaulted).autoscaling
    assert scaling is not None and scaling.prefill is None and scaling.scale_to_zero


def test_autoscaling_with_only_bounds_gets_the_documented_defaults() -> None:
    defaulted, problems = admit(crd_schema(), variant({"spec.autoscaling": AUTOSCALED}))
    assert problems == []
    scaling = parse_spec(defaulted).autoscaling
    assert scaling == parse_spec(variant({"spec.autoscaling": AUTOSCALED})).autoscaling
    assert scaling is not None
    assert (scaling.targets.percentile, scaling.targets.ttft_seconds, scaling.targets.itl_seconds) == (90, 2.0, 0.25)
    assert (scaling.scale_up_seconds, scaling.scale_down_seconds, scaling.interval_seconds) == (30, 300, 15)
    assert (scaling.ratio.min, scaling.ratio.max, scaling.hold_seconds) == (None, None, 300)
    assert not scaling.scale_to_zero
    assert parse_spec(variant({})).autoscaling is None  # no block: fixed replicas


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
