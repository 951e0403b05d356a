"""The plain routes: /v1/models, /health, /metrics, /tokenize, /detokenize, /tokenizer, and the OpenAI
shape of answers from routes that do not exist or fail."""

from __future__ import annotations

import httpx
import prometheus_client

from tandem_engine.entrypoints.api_server import REVISION_HEADER, build_app
from tandem_engine.frontend.interface import EngineDeadError
from tandem_router.hashing import BLOCK_HASH_SPEC
from tandem_router.tokenizer import PromptTokenizer
from tests.engine.entrypoints.toy_engine import BLOCK_SIZE, BOS, MODEL, ToyEngine, assert_error


async def test_models_health_metrics(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"], m["object"]) for m in models["data"]] == [(MODEL, 64, "model")]

    health = await client.get("/health")
    assert health.status_code == 200 and REVISION_HEADER not in health.headers  # no --revision given
    engine.ready = False  # draining
    assert (await client.get("/health")).status_code == 503
    engine.ready, engine.dead = True, EngineDeadError("gone")
    assert (await client.get("/health")).status_code == 503

    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'vllm:request_success_total{model_name="toy-model"} 3.0' in metrics.text
    # An engine without KV events tells routers so (a real one's answer: tests/engine/core/test_kv_events_e2e.py).
    assert (await client.get("/kv_events")).json() == {"block_size": None, "publishers": []}


async def test_tokenize_detokenize(client: httpx.AsyncClient) -> None:
    resp = (await client.post("/tokenize", json={"prompt": "hi"})).json()
    assert resp == {"tokens": [BOS, ord("h"), ord("i")], "count": 3, "max_model_len": 64}
    resp = (await client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})).json()
    assert resp["tokens"] == [ord("h"), ord("i")]
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})).json()
    assert chat["tokens"] == [BOS] + [ord(c) for c in "<user>x<assistant>"]
    assert chat["count"] == len(chat["tokens"])
    assert (await client.post("/detokenize", json={"tokens": [BOS, 104, 105]})).json() == {"prompt": "hi"}

    assert_error(await client.post("/tokenize", json={}), 400, "prompt")
    assert_error(await client.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")
    assert_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(await client.post("/detokenize", json={"tokens": [2**40]}), 400, "tokens")
    assert_error(await client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


async def test_tokenizer_serves_what_the_router_tokenizes_with(client: httpx.AsyncClient) -> None:
    resp = await client.get("/tokenizer")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    router = PromptTokenizer.from_json(resp.content)
    assert (router.model, router.block_size, router.spec.hash_spec) == (MODEL, BLOCK_SIZE, BLOCK_HASH_SPEC)

    async def engine_ids(body: dict[str, object]) -> list[int]:
        tokens: list[int] = (await client.post("/tokenize", json=body)).json()["tokens"]
        return tokens

    for prompt in ["hi there", "  two  spaces\nand a newline ", ""]:
        for special in (True, False):
            expected = await engine_ids({"prompt": prompt, "add_special_tokens": special})
            assert router.prompt_ids(prompt, add_special_tokens=special) == expected
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts},
            {"role": "assistant", "content": "ok", "name": None}, {"role": "user", "content": "more"}]
    for gen in (True, False):
        expected = await engine_ids({"messages": chat, "add_generation_prompt": gen})
        assert router.chat_ids(chat, add_generation_prompt=gen) == expected
    assert len(router.block_hashes(expected)) == len(expected) // BLOCK_SIZE


async def test_tokenizer_without_a_fast_tokenizer_is_501(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    engine.slow_tokenizer = True
    assert_error(await client.get("/tokenizer"), 501, contains="not a fast tokenizer")


async def test_unknown_route_and_method_are_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_bug_is_500_in_openai_shape(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "BUG", "max_tokens": 2})
    assert_error(resp, 500)
    assert resp.json()["error"]["message"] == "Internal server error"  # no internals leak
    assert resp.json()["error"]["type"] == "InternalServerError"  # as vLLM names it, one "Error"


async def test_health_tells_routers_the_engine_revision(engine: ToyEngine) -> None:
    app = build_app(engine, prometheus_client.CollectorRegistry(), revision="3f9a0c7e21b4")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert (await c.get("/health")).headers[REVISION_HEADER] == "3f9a0c7e21b4"
        engine.ready = False  # draining: still says which revision it is
        health = await c.get("/health")
        assert health.status_code == 503 and health.headers[REVISION_HEADER] == "3f9a0c7e21b4"
