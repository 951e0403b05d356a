"""What the apiserver does with a CRD's schema, done offline: defaulting, OpenAPI validation and CEL rules."""

from __future__ import annotations

import copy
from typing import Any

import celpy
from openapi_schema_validator import OAS30Validator


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural-schema defaulting: fill missing properties that declare a default, then recurse."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _openapi(schema: Any) -> Any:
    """Strip the Kubernetes extensions and `default` so a plain OpenAPI 3.0 validator can run it."""
    if isinstance(schema, dict):
        out = {k: _openapi(v) for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "default"}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in schema
        ):
            out["additionalProperties"] = False  # the apiserver prunes or (strict) rejects unknown fields
        return out
    if isinstance(schema, list):
        return [_openapi(v) for v in schema]
    return schema


def schema_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    # metadata is validated by the apiserver itself, not by the CRD schema.
    plain = _openapi(schema)
    plain["properties"]["metadata"] = {"type": "object"}
    validator = OAS30Validator(plain)
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj))


def cel_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Evaluate every `x-kubernetes-validations` rule where its value exists; return failed messages."""
    failures: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            failures.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                failures += cel_failures(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            failures += cel_failures(schema["items"], item, f"{path}[{i}]")
    return failures


def admit(schema: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default, then validate with the schema and the CEL rules: (defaulted object, problems)."""
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    problems = schema_errors(schema, defaulted)
    if not problems:  # the apiserver runs CEL only on schema-valid objects
        problems = cel_failures(schema, defaulted)
    return defaulted, problems


def all_rules(schema: Any) -> list[str]:
    rules: list[str] = []
    if isinstance(schema, dict):
        rules += [r["rule"] for r in schema.get("x-kubernetes-validations") or []]
        for v in schema.values():
            rules += all_rules(v)
    elif isinstance(schema, list):
        for v in schema:
            rules += all_rules(v)
    return rules
