"""Tool calling on /v1/chat/completions: the request's tools checked, rendered through a chat template, calls
demanded by a grammar (`tool_choice` `required` or a named function) and parsed out of the model's text
(docs/contracts.md, "Tool calling").

Two formats, both a `<tool_call>` tag around JSON:

- `smollm2`: one tag holding a JSON list of calls, `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`,
  what SmolLM2 was trained to write. Its chat template has no tools branch, so tandem renders a request with
  tools through TOOLS_TEMPLATE (frontend/chat_templates.py): SmolLM2's own ChatML, with the tools in the
  system turn, calls in assistant turns and results in `tool` turns.
- `hermes`: one tag per call holding one JSON object, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  what Qwen2.5 and Qwen3 write (their own chat templates render the tools).

`--tool-call-parser auto` picks hermes where the model's chat template renders tools, else smollm2.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem_engine.entrypoints.openai_protocol import OpenAIError
from tandem_engine.entrypoints.structured import closed_objects

ToolFormat = Literal["smollm2", "hermes"]
TOOL_FORMATS: tuple[str, ...] = ("auto", "smollm2", "hermes")
START, END = "<tool_call>", "</tool_call>"
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")



@dataclass
class Function:
    name: str
    parameters: dict[str, Any]
    strict: bool = False
    description: str | None = None


@dataclass
class ToolPlan:
    """What one chat request asks of tools: the functions, the choice, the format."""

    functions: list[Function]
    choice: str  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    format: ToolFormat = "smollm2"

    @property
    def parses(self) -> bool:
        """Whether the answer's text is searched for calls."""
        return self.choice != "none" and bool(self.functions)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (none where the choice is `none`: the model is not told)."""
        if not self.parses:
            return None
        return [{"type": "function", "function": {"name": f.name, "parameters": f.parameters,
                                                  **({"description": f.description} if f.description else {})}}
                for f in self.functions]


def parse_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                parallel_tool_calls: bool | None, fmt: ToolFormat) -> ToolPlan:
    """Check `tools` and `tool_choice` as OpenAI does; raises OpenAIError (400)."""
    functions: list[Function] = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise OpenAIError(f"tools[{i}].type must be 'function'", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise OpenAIError(f"tools[{i}].function must be an object with a name", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise OpenAIError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", param="tools")
        if any(f.name == name for f in functions):
            raise OpenAIError(f"tools[{i}]: a second function named {name!r}", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema (an object)", param="tools")
        strict = fn.get("strict") is True
        description = fn.get("description")
        functions.append(Function(name, params, strict, description if isinstance(description, str) else None))
    named = None
    if tool_choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise OpenAIError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
                              param="tool_choice")
        choice = tool_choice
    else:
        fn = tool_choice.get("function") if tool_choice.get("type", "function") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise OpenAIError("tool_choice must name a function: {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", param="tool_choice")
        if not any(f.name == named for f in functions):
            raise OpenAIError(f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
        choice = "named"
    if choice in ("required", "auto") and not functions:
        raise OpenAIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    return ToolPlan(functions, choice, named, parallel_tool_calls is not False, fmt)


def _call_schema(fn: Function) -> dict[str, Any]:
    params = closed_objects(fn.parameters) if fn.strict else fn.parameters
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tag(text: str, special_id: int | None) -> str:
    """A Lark terminal for a tag: the special token by id where the vocabulary has one, else the text."""
    return f"<[{special_id}]>" if special_id is not None else json.dumps(text)


def calls_grammar(plan: ToolPlan, special_ids: dict[str, int | None]) -> str | None:
    """The grammar that makes the answer nothing but calls (one of the named function, or one or more of any
    when `required`), each valid against its function's parameters; None where the choice demands none."""
    import llguidance

    if plan.choice not in ("required", "named"):
        return None
    functions = [f for f in plan.functions if plan.choice == "required" or f.name == plan.named]
    call: dict[str, Any] = {"anyOf": [_call_schema(f) for f in functions]} if len(functions) > 1 \
        else _call_schema(functions[0])
    compact = {"x-guidance": {"whitespace_flexible": False}}
    start, end = _tag(START, special_ids.get(START)), _tag(END, special_ids.get(END))
    many = plan.parallel and plan.choice == "required"
    if plan.format == "smollm2":
        calls = {"type": "array", "items": call, "minItems": 1, **({} if many else {"maxItems": 1}), **compact}
        lark = f"start: {start} %json {json.dumps(calls)} {end}"
    else:
        one = f'{start} "\\n" %json {json.dumps({**call, **compact})} "\\n" {end}'
        lark = f'start: call {"(" + json.dumps(chr(10)) + " call)*" if many else ""}\ncall: {one}'
    return str(llguidance.grammar_from("lark", lark))


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _calls_in(block: str) -> list[ParsedCall] | None:
    """The calls one `<tool_call>` block holds (a list or one object), or None if it holds something else."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ParsedCall(item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


class ToolCallParser:
    """Splits an answer's text, as it streams, into content and calls: text outside `<tool_call>` blocks is
    content (sent as soon as it cannot be the start of a tag), each block becomes its calls once it closes. A
    block ends at the first `</tool_call>` after which its JSON parses (the tag may sit inside a JSON string);
    one that holds no calls, or that the answer never closes, is content after all (sent at the end)."""

    def __init__(self, after: str = "") -> None:
        """`after`: the answer so far, already sent (a resumed answer's): read, and what it said dropped."""
        self.buffer = ""
        self.inside = False
        self.calls: list[ParsedCall] = []
        if after:
            self.feed(after)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content to send now, and the calls completed by this text."""
        self.buffer += text
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the answer: what is left as content (an unclosed block, a block of no calls, the start
        of a tag that never came), and the calls of blocks that waited behind a block of no calls."""
        content, calls = self._scan(final=True)
        rest, self.buffer, self.inside = self.buffer, "", False
        return content + rest, calls

    def read(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """`feed`, and at the end of the answer (`final`) `finish` too: the content to send and the new calls; once
        the answer has calls, content that is only the line breaks around them is dropped."""
        content, calls = self.feed(text)
        if final:
            rest, more = self.finish()
            content, calls = content + rest, calls + more
        return ("" if self.calls and not content.strip() else content), calls

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: `tool_calls` for an answer that stopped after calls."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _scan(self, final: bool) -> tuple[str, list[ParsedCall]]:
        content, calls = [], []
        while True:
            if not self.inside:
                at = self.buffer.find(START)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, START)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at:], True
            closed = self._close()
            if closed is None:
                if not final:
                    break
                # The answer ended: a block none of whose ends parses is text up to its first end, if it has one.
                end = self.buffer.find(END)
                if end < 0:
                    break
                content.append(self.buffer[:end + len(END)])
                self.buffer, self.inside = self.buffer[end + len(END):], False
                continue
            found, stop = closed
            calls += found
            self.buffer, self.inside = self.buffer[stop:], False
        self.calls += calls
        return "".join(content), calls

    def _close(self) -> tuple[list[ParsedCall], int] | None:
        """The calls of the block the buffer starts with and where it ends, once an end tag closes JSON calls."""
        end = self.buffer.find(END)
        while end >= 0:
            found = _calls_in(self.buffer[len(START):end].strip())
            if found is not None:
                return found, end + len(END)
            end = self.buffer.find(END, end + 1)
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def tool_format(chat_template: str | None, flag: str) -> ToolFormat:
    """The call format: the flag's, or (`auto`) hermes where the model's own template renders tools."""
    if flag in ("smollm2", "hermes"):
        return flag  # type: ignore[return-value]
    return "hermes" if chat_template and "tools" in chat_template and START in chat_template else "smollm2"


def template_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a chat template: each assistant call's `arguments` as an object (OpenAI sends them as JSON
    text; templates write them with `tojson`), as vLLM does."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except ValueError:
                        pass
                    c = {**c, "function": fn}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
