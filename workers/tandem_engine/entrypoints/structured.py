"""Structured outputs at the API: the grammar a request asks for, as llguidance's grammar definition, checked
here so that a grammar that cannot be compiled is a 400 naming the problem (docs/contracts.md,
"Structured outputs").

Sources, at most one per request: OpenAI's `response_format` (`json_object`, `json_schema` with `strict`),
vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`), and on chat a
`tool_choice` that demands calls (entrypoints/tools.py builds that schema). JSON comes out compact (no
whitespace between tokens: a small model left free to add whitespace may add it forever), unless
`structured_outputs.whitespace_pattern` says otherwise.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from tandem_engine.entrypoints.openai_protocol import OpenAIError

# What the JSON compiler does by default: compact separators, no free whitespace, unknown keywords refused.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                      "disable_fallback")


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that leaves it out (what OpenAI's
    strict mode means: no key the schema does not name)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in schema[key].items()}
    types = schema.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in schema
    if is_object and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_KEYS = frozenset({"items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties",
                             "if", "then", "else", "contains", "propertyNames", "additionalItems"})


def json_schema_grammar(schema: Any, param: str, options: dict[str, Any] | None = None) -> str:
    import llguidance

    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise OpenAIError(f"{param} must be a JSON schema (an object)", param=param.split(".")[0])
    try:
        defaults: Any = {**JSON_OPTIONS, **(options or {})}  # llguidance's JsonCompileOptions
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults))
    except ValueError as exc:
        raise OpenAIError(f"{param}: {exc}", param=param.split(".")[0]) from None


def from_response_format(response_format: dict[str, Any]) -> str | None:
    """OpenAI's `response_format`: None for `text`."""
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise OpenAIError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise OpenAIError("response_format.json_schema must be an object with a name and a schema",
                          param="response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise OpenAIError("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                          param="response_format")
    schema = spec.get("schema", {})
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OpenAIError("response_format.json_schema.strict must be a boolean", param="response_format")
    if strict:
        schema = closed_objects(schema)
    return json_schema_grammar(schema, "response_format.json_schema.schema")


def from_structured_outputs(spec: dict[str, Any]) -> str:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    import llguidance

    unknown = sorted(set(spec) - set(STRUCTURED_KINDS) - set(STRUCTURED_OPTIONS))
    if unknown:
        raise OpenAIError(f"structured_outputs: {', '.join(unknown)} not supported (supported: "
                          f"{', '.join(STRUCTURED_KINDS + STRUCTURED_OPTIONS)})", param="structured_outputs")
    given = [k for k in STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise OpenAIError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                          f"{', '.join(given) or 'none'}", param="structured_outputs")
    (kind,) = given
    value = spec[kind]
    if kind in ("json", "json_object"):
        options: dict[str, Any] = {}
        if isinstance(pattern := spec.get("whitespace_pattern"), str):
            options = {"whitespace_flexible": True, "whitespace_pattern": pattern}
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise OpenAIError(f"structured_outputs.json is not JSON: {exc}", param="structured_outputs") from None
        if spec.get("disable_additional_properties"):
            schema = closed_objects(schema)
        return json_schema_grammar(schema, f"structured_outputs.{kind}", options)
    if kind == "regex":
        if not isinstance(value, str):
            raise OpenAIError("structured_outputs.regex must be a string", param="structured_outputs")
        return str(llguidance.LLMatcher.grammar_from_regex(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise OpenAIError("structured_outputs.choice must be a non-empty list of strings",
                              param="structured_outputs")
        return str(llguidance.grammar_from("choice", json.dumps(value)))
    if not isinstance(value, str):
        raise OpenAIError("structured_outputs.grammar must be a string (Lark or GBNF)", param="structured_outputs")
    try:
        return str(llguidance.grammar_from("grammar", value))
    except ValueError as exc:
        raise OpenAIError(f"structured_outputs.grammar: {exc}", param="structured_outputs") from None


@functools.lru_cache(maxsize=512)
def grammar_error(grammar: str) -> str:
    """Why `grammar` does not compile ("" when it does): checked once per grammar."""
    import llguidance

    message = str(llguidance.LLMatcher.validate_grammar(grammar))
    return "" if message.startswith("WARNING") else message


def request_grammar(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                    tools_grammar: str | None = None) -> str | None:
    """The one grammar a request asks for (None: unconstrained), checked; raises OpenAIError (400)."""
    grammars = []
    if response_format is not None and (g := from_response_format(response_format)) is not None:
        grammars.append(("response_format", g))
    if structured_outputs is not None:
        grammars.append(("structured_outputs", from_structured_outputs(structured_outputs)))
    if tools_grammar is not None:
        grammars.append(("tool_choice", tools_grammar))
    if not grammars:
        return None
    if len(grammars) > 1:
        raise OpenAIError(f"{' and '.join(n for n, _ in grammars)} each constrain the output: send one",
                          param=grammars[1][0])
    ((param, grammar),) = grammars
    if message := grammar_error(grammar):
        raise OpenAIError(f"{param}: the grammar does not compile: {message}", param=param)
    return grammar
