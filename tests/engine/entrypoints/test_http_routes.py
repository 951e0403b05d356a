"""The plain routes: /v1/models, /health, /metrics, /tokenize, /detokenize, and the OpenAI shape of
answers from routes that do not exist or fail."""

from __future__ import annotations

import httpx

from tandem_engine.frontend.interface import EngineDeadError
from tests.engine.entrypoints.toy_engine import BOS, MODEL, ToyEngine, assert_error


async def test_models_health_metrics(client: httpx.AsyncClient, engine: ToyEngine) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"], m["object"]) for m in models["data"]] == [(MODEL, 64, "model")]

    assert (await client.get("/health")).status_code == 200
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


async def test_unknown_route_and_method_are_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_bug_is_500_in_openai_shape(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "BUG", "max_tokens": 2})
    assert_error(resp, 500)
    assert resp.json()["error"]["message"] == "Internal server error"  # no internals leak
    assert resp.json()["error"]["type"] == "InternalServerError"  # as vLLM names it, one "Error"
