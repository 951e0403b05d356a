"""The tool-call parser on answers as models write them, whole and streamed in every split, and the grammar
that demands calls: what it accepts is exactly what the parser reads as calls valid for their functions."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from tandem_engine.entrypoints.openai_protocol import OpenAIError
from tandem_engine.entrypoints.tools import ToolCallParser, calls_grammar, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

ANSWERS: list[tuple[str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("plain text, no call", "plain text, no call", []),
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),
    ('Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_call>', "Sure. ",
     [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
    # Hermes: one object per tag, several tags
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', "\n",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome"})]),
    # not calls: the text stays content
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>[{"name": "get_weather", "argu', '<tool_call>[{"name": "get_weather", "argu', []),
    ("a < b and <tool_ and <tool_call", "a < b and <tool_ and <tool_call", []),
    # the end tag inside a JSON string does not end the block
    ('<tool_call>[{"name": "get_time", "arguments": {"zone": "a</tool_call>b"}}]</tool_call>', "",
     [("get_time", {"zone": "a</tool_call>b"})]),
    # a block of no calls is text; a good one after it still counts
    ('<tool_call>oops</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "<tool_call>oops</tool_call>\n", [("get_time", {})]),
]


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_the_parser_reads_whole_and_streamed_answers_alike(text: str, content: str,
                                                          calls: list[tuple[str, dict[str, Any]]]) -> None:
    for step in (len(text) or 1, 1, 3, 7):
        parser, got_content, got_calls = ToolCallParser(), "", []
        for i in range(0, len(text), step):
            piece, found = parser.feed(text[i:i + step])
            got_content += piece
            got_calls += found
        rest, more = parser.finish()
        got_content += rest
        assert got_content == content, step
        assert [(c.name, json.loads(c.arguments)) for c in got_calls + more] == calls, step


def test_content_is_sent_as_soon_as_it_cannot_begin_a_tag() -> None:
    parser = ToolCallParser()
    assert parser.feed("Hello <to") == ("Hello ", [])
    assert parser.feed("night") == ("<tonight", [])


def test_bad_tool_choices_are_refused() -> None:
    with pytest.raises(OpenAIError, match="not among the tools"):
        parse_tools([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "smollm2")
    assert parse_tools(None, None, None, "smollm2").choice == "none"
    assert parse_tools([WEATHER], None, None, "smollm2").choice == "auto"


def tokenizer() -> llguidance.LLTokenizer:
    from transformers import AutoTokenizer

    from tandem_engine.config import EngineConfig
    from tandem_engine.models.loader import resolve_model, weights_dir

    config = EngineConfig()
    hf = AutoTokenizer.from_pretrained(weights_dir(resolve_model(config.model, config.cache_path)))
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf, n_vocab=49152, eos_token=[2])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["smollm2", "hermes"])
def test_the_calls_grammar_accepts_valid_calls_and_nothing_else(fmt: str) -> None:
    tok = tokenizer()

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar)
        return bool(m.consume_tokens(tok.tokenize_str(text))) and m.is_accepting()

    def written(*calls: tuple[str, dict[str, Any]]) -> str:
        objs = [json.dumps({"name": n, "arguments": a}, separators=(",", ":")) for n, a in calls]
        if fmt == "smollm2":
            return "<tool_call>[" + ",".join(objs) + "]</tool_call>"
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)

    required = calls_grammar(parse_tools([WEATHER, TIME], "required", None, fmt), {})  # type: ignore[arg-type]
    named = calls_grammar(parse_tools([WEATHER, TIME], {"function": {"name": "get_time"}}, None, fmt), {})  # type: ignore[arg-type]
    single = calls_grammar(parse_tools([WEATHER, TIME], "required", False, fmt), {})  # type: ignore[arg-type]
    assert required and named and single
    one, two = ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "UTC"})
    assert accepts(required, written(one)) and accepts(required, written(one, two))
    assert accepts(single, written(two)) and not accepts(single, written(one, two))
    assert accepts(named, written(two)) and not accepts(named, written(one))
    assert not accepts(required, written(("get_weather", {"unit": "c"})))  # city is required
    assert not accepts(required, written(("get_weather", {"city": "X", "unit": "k"})))
    assert not accepts(required, "Sure! " + written(one))
    assert not accepts(required, written(("launch", {})))
    # What the grammar takes, the parser reads back as calls that validate.
    content, calls = ToolCallParser().feed(written(one, two))
    assert content.strip() == ""
    for call in calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["function"]["parameters"]  # type: ignore[index]
        jsonschema.validate(json.loads(call.arguments), schema)
