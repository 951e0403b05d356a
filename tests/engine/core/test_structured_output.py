"""Structured output inside one EngineCore (the embedded model, in process): grammars compile off the busy
loop and once per grammar, a constrained request keeps its grammar state through preemption, and one whose
grammar fails or that is aborted while compiling ends cleanly with every KV block back."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.core.structured_output import Grammar, GrammarCompiler
from tandem_engine.entrypoints.structured import request_grammar
from tandem_engine.models.loader import resolve_model, weights_dir
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 4,
                            "maxItems": 8}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def grammar_of(schema: dict[str, Any]) -> str:
    grammar = request_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, None)
    assert grammar is not None
    return grammar


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    # 18 blocks of 16 tokens (one more than a request of max_model_len needs): six requests of ~100 tokens
    # cannot all stay; the newest is preempted.
    c = EngineCore(EngineConfig(dtype="float32", block_size=16, num_kv_blocks=18, max_model_len=256),
                   runner=ModelRunner)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def tokenizer(core: EngineCore) -> Any:
    return AutoTokenizer.from_pretrained(weights_dir(resolve_model(core.config.model, core.config.cache_path)))


Outcome = tuple[list[int], str | None, str | None]


def run(core: EngineCore, reqs: list[Request]) -> dict[str, Outcome]:
    """Step `core` until every request of `reqs` has finished: id -> (tokens, finish reason, error)."""
    for r in reqs:
        core.add_request(r)
    out: dict[str, Any] = {r.request_id: ([], None, None) for r in reqs}
    while core.has_requests:
        for o in core.step():
            tokens = out[o.request_id][0] + o.new_token_ids
            out[o.request_id] = (tokens, o.finish_reason, o.error)
    return out


def prompt(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def test_preempted_structured_requests_resume_in_their_grammar(core: EngineCore, tokenizer: Any) -> None:
    """Six sampled requests (temperature 1, seeds) under one schema in a cache too small for them all: some
    are preempted and recomputed, and every answer still validates against the schema."""
    grammar = grammar_of(SCHEMA)
    reqs = [Request(f"pre{i}", prompt(tokenizer, f"Person number {i} as JSON, please, with a long name."),
                    SamplingParams(max_tokens=200, temperature=1.0, seed=i, grammar=grammar), [2])
            for i in range(6)]
    out = run(core, reqs)
    assert sum(r.num_preemptions for r in reqs) > 0, "nothing was preempted: the test proves nothing"
    for rid, (tokens, finish, error) in out.items():
        assert error is None and finish == "stop", (rid, finish, error, tokenizer.decode(tokens))
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    assert core.scheduler.kv.usage == 0


def test_a_grammar_compiling_holds_up_no_other_request(core: EngineCore, tokenizer: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """While a grammar compiles (held here until released), another request is scheduled and answers in
    full; the constrained request then starts and answers within its grammar."""
    release = threading.Event()
    build = GrammarCompiler.build

    def slow_build(self: GrammarCompiler, grammar: str) -> Grammar:
        assert release.wait(60)
        return build(self, grammar)

    monkeypatch.setattr(GrammarCompiler, "build", slow_build)
    free = Request("free", prompt(tokenizer, "Say hi."), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                   [2])
    held = Request("held", prompt(tokenizer, "Yes or no?"), SamplingParams(
        max_tokens=8, temperature=0, grammar=request_grammar(None, {"choice": ["yes", "no"]})), [2])
    core.add_request(held)
    core.add_request(free)
    results: dict[str, list[int]] = {"free": [], "held": []}
    while core.has_requests:
        for o in core.step():
            results[o.request_id] += o.new_token_ids
            if o.request_id == "held":
                assert free.status.finished, "the constrained request ran before its grammar compiled"
        if free.status.finished:
            release.set()
    assert len(results["free"]) == 8
    assert tokenizer.decode(results["held"], skip_special_tokens=True) in ("yes", "no")


def test_a_grammar_is_compiled_once(core: EngineCore, tokenizer: Any) -> None:
    schema = {**SCHEMA, "title": "compiled once"}  # a grammar no other test compiled
    before = core.grammars.compiled
    reqs = [Request(f"once{i}", prompt(tokenizer, "JSON please."),
                    SamplingParams(max_tokens=60, temperature=1.0, seed=i, grammar=grammar_of(schema)), [2])
            for i in range(3)]
    run(core, reqs)
    assert core.grammars.compiled == before + 1
    run(core, [Request("once-more", prompt(tokenizer, "More JSON."),
                       SamplingParams(max_tokens=60, temperature=0, grammar=grammar_of(schema)), [2])])
    assert core.grammars.compiled == before + 1


def test_a_grammar_that_does_not_compile_ends_its_request_with_an_error(core: EngineCore, tokenizer: Any) -> None:
    """The frontend refuses such a grammar with a 400; should one reach the core all the same, its request ends
    with an error and takes nothing."""
    out = run(core, [Request("bad", prompt(tokenizer, "x"), SamplingParams(max_tokens=4, grammar="start: nowhere"),
                             [2])])
    tokens, finish, error = out["bad"]
    assert tokens == [] and finish == "error" and error is not None and "nowhere" in error
    assert core.scheduler.kv.usage == 0


def test_an_abort_while_the_grammar_compiles_ends_the_request(core: EngineCore, tokenizer: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    build = GrammarCompiler.build
    monkeypatch.setattr(GrammarCompiler, "build", lambda self, g: (release.wait(60), build(self, g))[1])
    core.add_request(Request("gone", prompt(tokenizer, "x"), SamplingParams(
        max_tokens=4, grammar=request_grammar(None, {"regex": "[a-z]+"})), [2]))
    core.abort_requests(["gone"])
    release.set()
    outputs = []
    while core.has_requests:
        outputs += core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("gone", "abort")]
    assert core.scheduler.kv.usage == 0
