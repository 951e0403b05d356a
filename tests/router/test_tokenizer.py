"""The router computes an engine's prompt tokens and KV block hashes exactly (docs/contracts.md, "Block
hashing"): its hash against the engine's own on random tokens, its tokenizer against a live engine's
/tokenize, and its block hashes against the BlockStored events that engine publishes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from tests.engine.engine_server import MODEL, run_server

from tandem_engine.core.block_pool import HASH_SPEC
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.kv_events import BlockStored, decode_batch
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_router.hashing import BLOCK_HASH_SPEC, token_block_hashes
from tandem_router.procs import free_port_pair
from tandem_router.tokenizer import PromptTokenizer, TokenizerSpec, fetch_tokenizer, template_messages

BS = 16
PARTS = [{"type": "text", "text": "First part."}, {"type": "text", "text": " second\tpart "}]
PROMPTS = [
    "Hello, world!",
    "Ünïcödé — 日本語のテキスト, emoji 😀👩‍👩‍👧‍👦 and a flag 🇫🇷, combining e\u0301",
    "  leading\n\n\n\ttabs   and    runs   \r\n trailing   ",
    "<|im_start|>user\nspecial-token text inside a prompt<|im_end|>",
    " ".join(f"word{i} ✓" for i in range(4000)),  # about 31,000 tokens
    "",
    " ",
    "\n",
]
CHATS: list[tuple[list[dict[str, Any]], bool]] = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}], True),
    ([{"role": "user", "content": "no system message: the template adds its own"}], True),
    ([{"role": "system", "content": "Count."}, {"role": "user", "content": "one"},
      {"role": "assistant", "content": "two"}, {"role": "user", "content": "three 😀"},
      {"role": "assistant", "content": "four\n\n  five"}, {"role": "user", "content": "six", "name": "bob"}], True),
    ([{"role": "user", "content": PARTS}], True),
    ([{"role": "user", "content": "end on the assistant's turn"}, {"role": "assistant", "content": "as is"}], False),
]


def engine_chain(tokens: list[int], block_size: int) -> list[int]:
    """The engine's block hashes of `tokens`, computed by its KV cache manager."""
    req = Request("r", tokens, SamplingParams(max_tokens=1), eos_token_ids=[0])
    KVCacheManager(num_blocks=2, block_size=block_size).update_block_hashes(req)
    return req.block_hashes


@pytest.mark.parametrize("block_size", [1, 2, 5, 16, 64])
def test_router_hashes_blocks_as_the_engine_does(block_size: int) -> None:
    assert BLOCK_HASH_SPEC == HASH_SPEC
    rng = random.Random(block_size)
    for length in [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size, *rng.sample(range(400), 20)]:
        tokens = [rng.choice([0, 1, 2**32 - 1, rng.randrange(2**32), rng.randrange(50_000)]) for _ in range(length)]
        hashes = token_block_hashes(tokens, block_size)
        assert hashes == engine_chain(tokens, block_size)
        assert len(hashes) == length // block_size
    # A chain: a prompt's hashes start with those of its prefix, and differ after the first differing block.
    a = [rng.randrange(50_000) for _ in range(10 * block_size)]
    b = a[: 4 * block_size] + [a[4 * block_size] + 1] + a[4 * block_size + 1 :]
    ha, hb = token_block_hashes(a, block_size), token_block_hashes(b, block_size)
    assert ha[:4] == hb[:4] and all(x != y for x, y in zip(ha[4:], hb[4:], strict=True))


def test_a_tokenizer_with_another_hash_is_refused() -> None:
    spec = TokenizerSpec(model="m", hash_spec="sha256:v9", block_size=BS, tokenizer_json="{}", chat_template=None,
                         special_tokens={})
    with pytest.raises(ValueError, match="sha256:v9"):
        PromptTokenizer(spec)


def test_messages_reach_the_template_as_the_engine_hands_them() -> None:
    msgs = [{"name": None, "content": PARTS, "role": "user", "reasoning": "hm", "x": 1}]
    assert template_messages(msgs) == [{"thinking": "hm", "role": "user", "content": "First part.\n second\tpart ",
                                        "reasoning": "hm", "x": 1, "reasoning_content": "hm"}]
    for bad in ([], [{"content": "no role"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "user", "content": 7}]):
        with pytest.raises(ValueError):
            template_messages(bad)


@dataclass
class Engine:
    url: str
    tokenizer: PromptTokenizer
    events: zmq.Socket[bytes]

    def tokenize(self, **body: Any) -> list[int]:
        resp = httpx.post(self.url + "/tokenize", json={"model": MODEL, **body}, timeout=60)
        assert resp.status_code == 200, resp.text
        tokens: list[int] = resp.json()["tokens"]
        return tokens

    def stored(self, want: list[int], timeout_s: float = 20.0) -> dict[int, tuple[int | None, list[int]]]:
        """Every block the engine announced (hash -> parent hash, tokens) once `want` are all among them."""
        blocks: dict[int, tuple[int | None, list[int]]] = {}
        deadline = time.monotonic() + timeout_s
        while not set(want) <= blocks.keys() and self.events.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            for event in decode_batch(self.events.recv_multipart()[2]).events:
                if isinstance(event, BlockStored):
                    parents = [event.parent_block_hash, *event.block_hashes[:-1]]
                    for i, (h, parent) in enumerate(zip(event.block_hashes, parents, strict=True)):
                        blocks[h] = (parent, event.token_ids[i * event.block_size : (i + 1) * event.block_size])
        return blocks


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    port = free_port_pair()  # PUB on the port, replay on the next
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")  # before the engine binds: no event is missed
    args = ["--kv-events-port", str(port), "--block-size", str(BS), "--max-model-len", "1024"]
    try:
        with run_server(args, Path(tmp_path_factory.mktemp("engine"))) as server:
            yield Engine(server.url, asyncio.run(fetch_tokenizer(server.url)), sub)
    finally:
        sub.close()


@pytest.mark.slow
def test_tokenizer_route_describes_the_engine(engine: Engine) -> None:
    body = httpx.get(engine.url + "/tokenizer", timeout=30)
    assert body.headers["content-type"] == "application/json"
    spec = msgspec.json.decode(body.content, type=TokenizerSpec)
    assert (spec.model, spec.block_size, spec.hash_spec) == (MODEL, BS, BLOCK_HASH_SPEC)
    assert spec.chat_template and {"bos_token", "eos_token"} <= spec.special_tokens.keys()
    assert engine.tokenizer.spec == spec


@pytest.mark.slow
@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_router_tokenizes_prompts_as_the_engine(engine: Engine, prompt: str, special: bool) -> None:
    expected = engine.tokenize(prompt=prompt, add_special_tokens=special)
    assert engine.tokenizer.prompt_ids(prompt, add_special_tokens=special) == expected
    assert engine.tokenizer.prompt_ids(expected) == expected  # token ids are the prompt


@pytest.mark.slow
@pytest.mark.parametrize(("messages", "generation"), CHATS, ids=range(len(CHATS)))
def test_router_renders_chats_as_the_engine(engine: Engine, messages: list[dict[str, Any]], generation: bool) -> None:
    expected = engine.tokenize(messages=messages, add_generation_prompt=generation)
    assert engine.tokenizer.chat_ids(messages, add_generation_prompt=generation) == expected


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}
ASK = {"role": "user", "content": "Weather in Paris?"}
TOOL_CHATS: list[tuple[list[dict[str, Any]], list[Any] | None, Any]] = [
    ([ASK], [WEATHER], None),
    ([{"role": "system", "content": "Be brief."}, ASK], [WEATHER, {"type": "function", "function": {"name": "t"}}],
     "required"),
    ([ASK], [WEATHER], "none"),
    ([ASK, CALLED, RESULT], [WEATHER], "auto"),
    ([ASK, CALLED, RESULT], None, None),
]


@pytest.mark.slow
@pytest.mark.parametrize(("messages", "tools", "choice"), TOOL_CHATS, ids=range(len(TOOL_CHATS)))
def test_router_renders_chats_with_tools_as_the_engine(engine: Engine, messages: list[dict[str, Any]],
                                                       tools: list[Any] | None, choice: Any) -> None:
    """A chat with tools, or with calls and their results, hashes as the engine's prompt: prefix-aware routing
    sees the blocks an engine holds for it."""
    expected = engine.tokenize(messages=messages, tools=tools, tool_choice=choice)
    assert engine.tokenizer.chat_ids(messages, True, tools, choice) == expected
    if choice == "none":  # the model is not told of tools it may not call
        assert expected == engine.tokenize(messages=messages)
    elif tools:
        assert expected != engine.tokenize(messages=messages, tool_choice="none")


@pytest.mark.slow
def test_router_refuses_the_chats_the_engine_refuses(engine: Engine) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    resp = httpx.post(engine.url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    assert resp.status_code == 400
    with pytest.raises(ValueError, match="chat template"):
        engine.tokenizer.chat_ids(messages)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_router_hashes_equal_the_engines_stored_blocks(engine: Engine, kind: str) -> None:
    story = "The lighthouse keeper counted ships past the rocks, night after night, year after year. " * 10
    if kind == "completions":
        body: dict[str, Any] = {"prompt": f"[{kind}] {story}"}
        ids = engine.tokenizer.prompt_ids(body["prompt"])
    else:
        body = {"messages": [{"role": "system", "content": f"[{kind}] Tell stories."},
                             {"role": "user", "content": [{"type": "text", "text": story}]}]}
        ids = engine.tokenizer.chat_ids(body["messages"])
    want = engine.tokenizer.block_hashes(ids)
    assert len(want) == len(ids) // BS >= 10
    resp = httpx.post(f"{engine.url}/v1/{'chat/' if kind == 'chat' else ''}completions", timeout=120,
                      json={"model": MODEL, "max_tokens": 1, "temperature": 0.0, **body})
    assert resp.status_code == 200, resp.text
    blocks = engine.stored(want)
    # The engine stored exactly this chain: each block's parent is the one before, the first has none,
    # and each holds the router's tokens.
    assert [blocks.get(h) for h in want] == [
        (parent, ids[i * BS : (i + 1) * BS]) for i, parent in enumerate([None, *want[:-1]])
    ]
