"""Structured outputs and tool calling on the embedded model through `tandem serve`, with the official `openai`
client: what an agent or a program sends, and what it gets back."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.engine.engine_server import MODEL, Server, run_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]


class Role(enum.StrEnum):
    admin = "admin"
    user = "user"
    guest = "guest"


class Address(pydantic.BaseModel):
    city: str
    country: str


class Person(pydantic.BaseModel):
    name: str
    age: int
    role: Role
    hobbies: list[str]
    address: Address
    nickname: str | None = None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server([], tmp_path_factory.mktemp("structured")) as s:
        yield s


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


ASK_PERSON = [{"role": "user", "content": "Describe a person named Ada who lives in London, as JSON."}]


def test_parse_with_a_pydantic_model_returns_the_object_streamed_and_not(client: openai.OpenAI) -> None:
    for seed in range(3):
        done = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON, response_format=Person,  # type: ignore[arg-type]
                                             max_tokens=300, temperature=0 if seed == 0 else 1, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, Person), done.choices[0].message.content
    with client.chat.completions.stream(model=MODEL, messages=ASK_PERSON, response_format=Person,  # type: ignore[arg-type]
                                        max_tokens=300, temperature=0) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)
    greedy = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON, response_format=Person,  # type: ignore[arg-type]
                                           max_tokens=300, temperature=0)
    assert final.choices[0].message.parsed == greedy.choices[0].message.parsed


def test_json_object_is_json(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the capital of France as a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


SAMPLING: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 1.0},
    {"temperature": 1.5, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 1.0, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3},
    {"temperature": 1.0, "min_tokens": 3},
]


@pytest.mark.parametrize("sampling", SAMPLING, ids=lambda s: ",".join(s))
def test_regex_and_choice_hold_in_every_sampling_mode(server: Server, sampling: dict[str, Any]) -> None:
    for seed in range(4):
        body = {"model": MODEL, "prompt": "My phone number is", "max_tokens": 20, "seed": seed, "n": 2,
                "structured_outputs": {"regex": r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"}, **sampling}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert re.fullmatch(r"\+[0-9]{2} [0-9]{3}-[0-9]{4}", choice["text"]), choice
            assert choice["finish_reason"] == "stop"
        body = {"model": MODEL, "prompt": "Is the sea wet? Answer:", "max_tokens": 20, "seed": seed,
                "structured_outputs": {"choice": ["yes", "no", "maybe so"]}, **sampling}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe so"), r.text


def test_seeded_structured_answers_repeat(client: openai.OpenAI) -> None:
    def once() -> str | None:
        return client.chat.completions.create(model=MODEL, messages=ASK_PERSON, seed=7, temperature=1,
                                              max_tokens=120, response_format={"type": "json_object"}
                                              ).choices[0].message.content
    assert once() == once()


def test_logprobs_are_those_of_the_tokens_the_grammar_allows(server: Server) -> None:
    """vLLM's raw logprobs, taken after the grammar's mask: every alternative offered has a finite logprob only
    if the grammar allowed it, and those of one step sum to at most 1."""
    body = {"model": MODEL, "prompt": "Pick a colour:", "max_tokens": 5, "logprobs": 5, "temperature": 0,
            "structured_outputs": {"choice": ["red", "green", "blue"]}}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["text"] in ("red", "green", "blue")
    first = choice["logprobs"]["top_logprobs"][0]
    allowed = {t: lp for t, lp in first.items() if lp > -9999}
    assert allowed and all(any(c.startswith(t.strip()) for c in ("red", "green", "blue")) for t in allowed), first
    assert sum(2.718281828 ** lp for lp in allowed.values()) <= 1.0001


def test_tool_choice_required_always_calls_with_valid_arguments(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]
    for seed in range(12):
        done = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],  # type: ignore[list-item]
                                              tool_choice="required", temperature=1, seed=seed, max_tokens=200)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in range(6):
        done = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me something."}], tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1, seed=seed,
            max_tokens=120, parallel_tool_calls=False)
        calls = done.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_time"])


def test_streamed_calls_arrive_as_tool_call_deltas(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                            temperature=0, max_tokens=120, stream=True)
    chunks = list(stream)
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                           temperature=0, max_tokens=120)
    streamed = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert whole.choices[0].message.tool_calls
    assert json.loads(streamed) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_auto_answers_calls_when_the_model_writes_them_and_text_otherwise(client: openai.OpenAI) -> None:
    """Under `auto` nothing is forced and the parser reads whatever the model writes. What it writes is pinned
    here by a regex (`structured_outputs` beside `auto`): a call in SmolLM2's format comes back as a call, with
    finish_reason tool_calls, streamed or not; words come back as content."""
    call = r'<tool_call>\[\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}\]</tool_call>'
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for stream in (False, True):
        kw: dict[str, Any] = {"model": MODEL, "messages": ask, "tools": [WEATHER], "tool_choice": "auto",
                              "max_tokens": 80, "temperature": 0, "extra_body": {"structured_outputs": {"regex": call}}}
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
            assert [(d.function.name, json.loads(d.function.arguments or "")) for d in deltas if d.function] == \
                [("get_weather", {"city": "Paris", "unit": "celsius"})]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            assert not "".join(c.delta.content or "" for ch in chunks for c in ch.choices).strip()
        else:
            done = client.chat.completions.create(**kw)
            assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.content is None
            (got,) = done.choices[0].message.tool_calls or []
            assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather", {"city": "Paris",
                                                                                               "unit": "celsius"})
    words = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="auto",  # type: ignore[list-item]
                                           max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "It is [a-z]+ there[.]"}})
    assert words.choices[0].finish_reason == "stop" and not words.choices[0].message.tool_calls
    assert re.fullmatch("It is [a-z]+ there[.]", words.choices[0].message.content or "")
    text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30)  # type: ignore[list-item]
    assert text.choices[0].message.content and not text.choices[0].message.tool_calls


def test_a_tool_result_goes_back_to_the_model_in_a_second_turn(client: openai.OpenAI, server: Server) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                           temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,  # type: ignore[list-item]
                                            max_tokens=40)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The template wrote the call and its result into the prompt.
    rendered = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60).json()
    prompt = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": rendered["tokens"]},
                        timeout=60).json()["prompt"]
    assert "21 degrees and sunny" in prompt and '"name": "get_weather"' in prompt and call.function.name in prompt


def test_bad_schemas_and_tools_are_400s(server: Server) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "get_time"),
    ]
    for extra, needle in cases:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def openai_request_fields() -> Any:
    """Chat requests whose response_format, tools, tool_choice and parallel_tool_calls are drawn from the
    `openai` SDK's request types (generated from OpenAI's OpenAPI spec), as JSON schemas."""
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema
    from openai.types.chat import ChatCompletionToolChoiceOptionParam, ChatCompletionToolUnionParam
    from openai.types.chat.completion_create_params import ResponseFormat

    def schema(t: Any) -> Any:
        return from_schema(pydantic.TypeAdapter(t).json_schema())

    return st.fixed_dictionaries({}, optional={
        "response_format": schema(ResponseFormat),
        "tools": st.lists(schema(ChatCompletionToolUnionParam), max_size=3),
        "tool_choice": schema(ChatCompletionToolChoiceOptionParam),
        "parallel_tool_calls": st.booleans(),
    })


def test_a_fuzz_of_openais_request_types_finds_no_5xx(server: Server) -> None:
    """Whatever OpenAI's own types allow in these fields: a 200 or an OpenAI-shaped 4xx, never a 5xx."""
    from hypothesis import HealthCheck, given, settings

    seen: dict[int, int] = {}

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(openai_request_fields())
    def one(fields: dict[str, Any]) -> None:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (fields, r.text)
        if r.status_code != 200:
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["message"], r.text

    one()
    assert seen.get(200) and seen.get(400), seen  # both kinds were drawn
