"""Concurrent streamed requests as a client reads them (text, token ids, finish reasons, usage, error
events), for the migration tests: a run without failures is the reference for one with them."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from tests.engine.engine_server import MODEL

MAX_TOKENS = 64


def request(i: int) -> tuple[str, dict[str, Any]]:
    """Request i: chat for odd i, completions for even; seeded sampling for i % 4 >= 2, else greedy."""
    sampling: dict[str, Any] = {"temperature": 0.0} if i % 4 < 2 else {"temperature": 0.9, "top_p": 0.95,
                                                                         "seed": 1000 + i}
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}, **sampling}
    topic = ["lighthouses", "tides", "ferries", "anchors"][i % 4]
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    return "/v1/completions", {**body, "prompt": f"Story {i}: the keeper of the {topic} said"}


class Reader:
    """One streamed request: its text, its token ids, its finish reasons and usage, and its tool calls (name and
    arguments by index, joined from their deltas), as the client saw them."""

    def __init__(self, i: int, build: Any = None) -> None:
        self.i = i
        self.build = build or request
        self.text, self.ids, self.finish, self.usage, self.errors = "", [], [], None, []
        self.calls: dict[int, dict[str, str]] = {}
        self.chunks = 0

    async def run(self, http: aiohttp.ClientSession, url: str) -> None:
        path, body = self.build(self.i)
        async with http.post(url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                self.usage = event.get("usage") or self.usage
                for c in event.get("choices", []):
                    self.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    self.ids += c.get("token_ids") or []
                    for call in (c.get("delta") or {}).get("tool_calls") or []:
                        seen = self.calls.setdefault(call["index"], {"name": "", "arguments": ""})
                        seen["name"] += call.get("function", {}).get("name") or ""
                        seen["arguments"] += call.get("function", {}).get("arguments") or ""
                    if c.get("finish_reason"):
                        self.finish.append(c["finish_reason"])
                    self.chunks += 1


async def run_all(url: str, n: int, during: Any = None, build: Any = None) -> list[Reader]:
    """`n` requests (`build(i)` -> (path, body); default `request`) at once; `during(readers)` runs while they
    stream."""
    readers = [Reader(i, build) for i in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        tasks = [asyncio.create_task(r.run(http, url)) for r in readers]
        if during is not None:
            await during(readers)
        await asyncio.gather(*tasks)
    return readers


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


