"""Drives an OpenAI endpoint: one streamed request at a time per session, timing every chunk."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem_router.bench.workload import Session


@dataclass
class Record:
    start: float  # seconds since the benchmark began
    group: int
    turn: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: the engine's prefix-cache hit
    output_tokens: int = 0
    text: str = ""
    body: dict[str, Any] = field(default_factory=dict, repr=False)  # what was sent
    request_id: str = ""  # sent as X-Request-Id when set (the router logs it, e.g. with a migration)
    route: str = ""  # the router's X-Tandem-Route answer header: where it sent the request and why

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Target:
    url: str
    model: str
    endpoint: str  # completions | chat
    output_len: int
    api_key: str | None = None
    timeout: float = 600.0
    # Awaited with (path, body, record) just before each request is sent (bench scripts that also
    # ask routers where they would send it).
    before: Callable[[str, dict[str, Any], Record], Awaitable[None]] | None = None


async def one_request(
    http: aiohttp.ClientSession,
    target: Target,
    messages: list[dict[str, str]],
    prompt: str | list[int],
    rec: Record,
    t0: float,
    output_len: int | None = None,
) -> None:
    """One streamed request: `prompt` (text, or token ids) to completions, `messages` to chat."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": output_len or target.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if target.endpoint == "chat":
        body["messages"] = messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    if rec.request_id:
        headers["X-Request-Id"] = rec.request_id
    rec.body = body
    if target.before is not None:
        await target.before(path, body, rec)
    start = time.perf_counter()
    rec.start = start - t0
    last = start
    pieces: list[str] = []
    chunks = 0
    try:
        async with http.post(
            target.url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=target.timeout)
        ) as resp:
            rec.route = resp.headers.get("X-Tandem-Route", "")
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = str(data["error"].get("message"))
                    return
                if usage := data.get("usage"):
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.output_tokens = usage.get("completion_tokens", 0)
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in data.get("choices") or []:
                    piece = (
                        choice.get("text") if target.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                    )
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(piece)
        rec.e2e = time.perf_counter() - start
        rec.output_tokens = rec.output_tokens or chunks
        rec.text = "".join(pieces)
        rec.ok = chunks > 0
        if not rec.ok:
            rec.error = "no tokens"
    except (TimeoutError, aiohttp.ClientError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_session(
    http: aiohttp.ClientSession, target: Target | Callable[[], Target], sess: Session, t0: float,
    records: list[Record],
) -> None:
    """The session's turns one after another, each carrying the history; `target` may be a callable that
    picks one per request (a load balancer in front of router replicas)."""
    if sess.token_prompt is not None:  # a trace's request: one prompt of token ids
        rec = Record(start=0.0, group=sess.group, turn=0)
        records.append(rec)
        await one_request(http, target if isinstance(target, Target) else target(), [], sess.token_prompt, rec, t0,
                          sess.output_len)
        return
    history: list[dict[str, str]] = []
    for turn, user in enumerate(sess.turns):
        messages = (
            ([{"role": "system", "content": sess.system}] if sess.system else [])
            + history
            + [{"role": "user", "content": user}]
        )
        prompt = (sess.system + "\n" if sess.system else "") + "".join(f"{m['content']}\n" for m in history) + user
        rec = Record(start=0.0, group=sess.group, turn=turn)
        records.append(rec)
        await one_request(http, target if isinstance(target, Target) else target(), messages, prompt, rec, t0)
        if not rec.ok:
            return
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": rec.text}]


async def run(
    target: Target, sessions: list[Session], concurrency: int | None, request_rate: float | None, seed: int
) -> tuple[list[Record], float]:
    """Sessions start at their own arrival times (a trace), at a Poisson `request_rate` (per second), or
    `concurrency` run at once; with arrival times or a rate, `concurrency` bounds how many are in flight (a
    session due while that many run starts when one ends)."""
    records: list[Record] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        t0 = time.perf_counter()
        starts: list[float] | None = None
        if sessions and all(s.arrival is not None for s in sessions):
            starts = [s.arrival or 0.0 for s in sessions]
        elif request_rate:
            rng, at, starts = random.Random(seed), 0.0, []
            for _ in sessions:
                starts.append(at)
                at += rng.expovariate(request_rate)
        if starts is not None:
            bound = asyncio.Semaphore(concurrency or 1_000_000)

            async def bounded(s: Session) -> None:
                async with bound:
                    await run_session(http, target, s, t0, records)

            tasks = []
            for s, at in zip(sessions, starts, strict=True):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                tasks.append(asyncio.create_task(bounded(s)))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(sessions))

            async def worker() -> None:
                while queue:
                    await run_session(http, target, queue.pop(), t0, records)

            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        duration = time.perf_counter() - t0
    return records, duration


async def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        return str((await resp.json())["data"][0]["id"])


async def scrape_prefix_cache(urls: list[str]) -> dict[str, float]:
    """Sum of `vllm:prefix_cache_hits` and `vllm:prefix_cache_queries` over the given engines."""
    totals = {"hits": 0.0, "queries": 0.0}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("#") or not line.strip():
                    continue
                name = line.split("{")[0].split(" ")[0]
                value = float(line.rsplit(" ", 1)[1])
                if name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"):
                    totals["hits"] += value
                elif name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"):
                    totals["queries"] += value
    return totals
