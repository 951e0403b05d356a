"""P/D membership changes under load: what a rollout and a scale-down cost the requests that run through them,
before and after revision-paired P/D and the prefill engines' KV-lease drain (issue 42).

Local processes stand in for Kubernetes: `tandem route` (static discovery, health checks every 0.5 s,
round-robin) in front of two prefill and two decode engines; the router's health checks do what
EndpointSlices do, and a Deployment's rollout is played by replacing engine processes on the same ports.
`--concurrency` client loops send streamed completions (a prompt new to every engine, greedy,
`--max-tokens` tokens) one after another. Per mode, three windows of `--window` seconds under that load:

    steady      no change: the baseline
    rollout     an incompatible change (block size 16 -> 32): prefill-0, decode-0, prefill-1, decode-1 in turn
                get SIGTERM, exit, and are started again on the same ports with the new block size (and, in
                `after`, the next --revision), each healthy before the next
    scale-down  prefill-1 and decode-1 get SIGTERM at once; the load goes on on the two left

The load starts `--lead` seconds before the window (which opens with the change); a window outlasted by its
change stays open until `--settle` seconds after it. Statistics are over the requests started in the window.
A request failed if it was answered non-200, carried an SSE error event, ended without [DONE] or with a
finish_reason other than "length". Modes, in one run: `after` is this working tree; `before` is
`--before-commit` (b579718^: no revisions, no KV-lease drain) run from a git worktree with the same
interpreter. Results: bench/results/pd_membership.*.

    .venv/bin/python bench/pd_membership.py [--modes before,after --scenarios steady,rollout,scale-down --window 120]

takes about 15 minutes on 2 cores (a rollout there takes 60 to 100 s: each new engine loads and warms up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from harness import MODEL, bench_main, describe, text

from tandem_router.bench.stats import describe as stats
from tandem_router.procs import Child, free_port, metric, stop_all, tandem_child

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("steady", "rollout", "scale-down")
ROLLOUT_ORDER = ("prefill-0", "decode-0", "prefill-1", "decode-1")
GENERATIONS = ((16, "r1"), (32, "r2"))  # (block size, revision): before and after the rollout
ROUTER_FAMILIES = {"pd_decisions": ("tandem:router_pd_decisions_total", "decision"),
                   "migrations": ("tandem:router_migrations_total", "reason"),
                   "retries": ("tandem:router_retries_total", "role"),
                   "answers": ("tandem:router_requests_total", "status")}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", type=lambda v: v.split(","), default=["before", "after"])
    p.add_argument("--scenarios", type=lambda v: [s for s in SCENARIOS if s in v.split(",")], default=list(SCENARIOS))
    p.add_argument("--window", type=float, default=120.0,
                   help="seconds per scenario from the change: longer than the rollout (about 100 s on 2 cores)")
    p.add_argument("--lead", type=float, default=5.0, help="seconds of load before the window")
    p.add_argument("--settle", type=float, default=3.0, help="seconds the window stays open after a late change")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--drain-seconds", type=int, default=30, help="after: the engines' --drain-seconds")
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="per engine, with --max-model-len 1024: ample "
                   "for the load (the engines' 1 GiB times four crowds a small machine)")
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--before-commit", default="b579718^")
    p.add_argument("--before-tree", default="/tmp/tandem-before")
    p.add_argument("--start-timeout", type=float, default=900.0, help="an engine's health wait (kernels may build)")
    return p.parse_args()


# -- pure helpers -------------------------------------------------------------------------------------------

def failure(status: int, error: str, done: bool, finish_reason: str | None) -> str:
    """Why a streamed answer failed, "" if it did not; status 0: no answer came (`error` says why)."""
    if status != 200:
        return (f"HTTP {status}: {error}" if status else error)[:160]
    if error:
        return error[:160]
    if not done:
        return "no [DONE]"
    return "" if finish_reason == "length" else f"finish_reason {finish_reason}"


def by_label(prom: str, name: str, label: str) -> dict[str, float]:
    """The samples of counter `name` in Prometheus text, summed per value of `label`."""
    out: dict[str, float] = {}
    pattern = re.compile(rf'{label}="([^"]*)"')
    for line in prom.splitlines():
        if line.startswith(name + "{"):
            m = pattern.search(line)
            key = m.group(1) if m else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counter increments, the keys that moved only."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}


@dataclass
class Req:
    start: float = 0.0  # seconds since the window opened (negative: in the lead)
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)


def summarize(records: list[Req], window_s: float) -> dict[str, Any]:
    """Requests started in [0, window_s): counts, failures by reason, TTFT and ITL (ms) of the ok ones, their
    maximum too (one request's stall, a replay say, is below a p99 of fewer than 100 requests)."""
    inside = [r for r in records if 0 <= r.start < window_s]
    ok = [r for r in inside if r.ok]

    def ms(values: list[float]) -> dict[str, float]:
        return {**stats(values), "max": max(values, default=math.nan) * 1000}

    return {"requests": len(inside), "failed": len(inside) - len(ok),
            "failed_whole_run": sum(not r.ok for r in records), "requests_whole_run": len(records),
            "errors": dict(Counter(r.error for r in records if not r.ok)),
            "ttft_ms": ms([r.ttft for r in ok]), "itl_ms": ms([x for r in ok for x in r.itl])}


def ratios(by_scenario: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each changing scenario's TTFT and ITL p99 over the same mode's steady p99 (None: no steady one)."""
    base = by_scenario.get("steady")
    out: dict[str, dict[str, float | None]] = {}
    for name, s in by_scenario.items():
        if name == "steady":
            continue
        out[name] = {k: (s[k]["p99"] / base[k]["p99"] if base and base[k]["p99"] else None)
                     for k in ("ttft_ms", "itl_ms")}
    return out


# -- processes ----------------------------------------------------------------------------------------------

def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def source_tree(mode: str, a: argparse.Namespace) -> tuple[Path, str]:
    """Where a mode's code lives and its commit; `before` gets a worktree of --before-commit (reused)."""
    if mode == "after":
        return REPO, git("rev-parse", "HEAD")
    sha, tree = git("rev-parse", a.before_commit), Path(a.before_tree)
    if not tree.exists():
        git("worktree", "prune")  # a worktree whose folder went (a cleared /tmp) is still registered
        git("worktree", "add", "--detach", str(tree), sha)
    if git("rev-parse", "HEAD", cwd=tree) != sha:
        raise SystemExit(f"{tree} is not at {a.before_commit} ({sha}): remove it or pass --before-tree")
    return tree, sha


def code_env(tree: Path) -> dict[str, str]:
    # Ahead of the editable install's finder (appended to sys.meta_path): these packages win.
    return {"PYTHONPATH": f"{tree / 'workers'}:{tree / 'operator'}"}


def imported_from(tree: Path) -> dict[str, str]:
    """Where the mode's interpreter and environment import tandem's packages from (verified against `tree`)."""
    probe = ("import json, tandem_cli, tandem_engine, tandem_router; print(json.dumps({m.__name__: m.__file__ "
             "for m in (tandem_cli, tandem_engine, tandem_router)}))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **code_env(tree)}, cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    files: dict[str, str] = json.loads(out)
    if not all(Path(f).is_relative_to(tree) for f in files.values()):
        raise SystemExit(f"the processes for {tree} would import {files}")
    return files


@dataclass
class Engine:
    name: str
    role: str
    child: Child
    side_port: int | None
    gen: int = 0

    def argv(self, mode: str, a: argparse.Namespace) -> list[str]:
        block, revision = GENERATIONS[self.gen]
        args = ["--model", MODEL, "--dtype", "float32", "--num-threads", "1", "--role", self.role,
                "--block-size", str(block), "--kv-cache-gib", str(a.kv_cache_gib), "--max-model-len", "1024"]
        if self.side_port:
            args += ["--kv-side-channel-port", str(self.side_port)]
        if mode == "after":  # b579718^ knows neither flag
            args += ["--revision", revision, "--drain-seconds", str(a.drain_seconds)]
        port = self.child.url.rsplit(":", 1)[1]
        return tandem_child(self.name, "serve", args, self.child.log_path, port=int(port)).argv


class Stack:
    """The router and four engines of one mode, built here and started by `up()`."""

    def __init__(self, mode: str, a: argparse.Namespace, logs: Path) -> None:
        self.mode, self.a = mode, a
        self.tree, self.commit = source_tree(mode, a)
        env = code_env(self.tree)
        self.engines: list[Engine] = []
        for role in ("prefill", "decode"):
            for i in range(2):
                name = f"{role}-{i}"
                child = tandem_child(name, "serve", [], logs / mode / f"{name}.log", env=env)
                self.engines.append(Engine(name, role, child, free_port() if role == "prefill" else None))
        for e in self.engines:
            e.child.argv, e.child.cwd = e.argv(mode, a), self.tree
        urls = {role: ",".join(e.child.url for e in self.engines if e.role == role) for role in ("prefill", "decode")}
        self.router = tandem_child("router", "route", ["--prefill", urls["prefill"], "--decode", urls["decode"],
                                                       "--policy", "round-robin", "--health-interval",
                                                       str(a.health_interval)], logs / mode / "router.log", env=env)
        self.router.cwd = self.tree

    def children(self) -> list[Child]:
        return [*(e.child for e in self.engines), self.router]

    def engine(self, name: str) -> Engine:
        return next(e for e in self.engines if e.name == name)

    async def up(self) -> None:
        for e in self.engines:
            e.child.start()
        await asyncio.gather(*(asyncio.to_thread(e.child.wait_healthy, self.a.start_timeout) for e in self.engines))
        self.router.start()
        await asyncio.to_thread(self.router.wait_healthy, 60)

    async def reset(self) -> None:
        """Every engine up at the first generation again (after a scale-down or a rollout)."""
        stale = [e for e in self.engines if e.gen or not e.child.alive()]
        await asyncio.gather(*(asyncio.to_thread(e.child.stop) for e in stale))
        for e in stale:
            sweep(e.child)
            e.gen = 0
            e.child.argv = e.argv(self.mode, self.a)
            e.child.start()
        await asyncio.gather(*(asyncio.to_thread(e.child.wait_healthy, self.a.start_timeout) for e in stale))
        await asyncio.sleep(4 * self.a.health_interval + 1)  # the router admits them again

    def revisions(self) -> dict[str, str | None]:
        """What each running engine's /health says its revision is (X-Tandem-Revision; none before b579718)."""
        out = {}
        for e in self.engines:
            with urllib.request.urlopen(e.child.url + "/health", timeout=5) as resp:
                out[e.name] = resp.headers.get("X-Tandem-Revision")
        return out


def sweep(child: Child) -> None:
    """SIGKILL to what is left of the server's process group: a server stopped while it starts can leave its
    EngineCores behind (seen under memory pressure)."""
    if child.proc is not None and child.proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return str(resp.read().decode())


class KvCounters:
    """The decode engines' KV-transfer counters over a scenario, per process: a replaced or stopped engine's
    last reading counts, a process started in the scenario counts from zero."""

    NAMES = ("tandem:kv_transfer_failures_total", "tandem:kv_transfer_received_blocks_total")

    def __init__(self, engines: list[Engine]) -> None:
        self.decodes = [e for e in engines if e.role == "decode"]
        self.base: dict[tuple[str, int], list[float]] = {}
        self.last: dict[tuple[str, int], list[float]] = {}

    async def poll(self, baseline: bool = False) -> None:
        for e in self.decodes:
            if not e.child.alive() or e.child.proc is None:
                continue
            try:
                prom = await asyncio.to_thread(metrics_text, e.child.url)
            except OSError:  # stopping: its last reading stands
                continue
            key = (e.name, e.child.proc.pid)
            self.last[key] = [metric(prom, n) for n in self.NAMES]
            if baseline:
                self.base[key] = list(self.last[key])

    async def follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll()
            await asyncio.sleep(1.0)

    def totals(self) -> dict[str, float]:
        return {n.removeprefix("tandem:"): sum(v[i] - self.base.get(k, [0.0, 0.0])[i] for k, v in self.last.items())
                for i, n in enumerate(self.NAMES)}


# -- load and changes ---------------------------------------------------------------------------------------

async def stream_one(http: aiohttp.ClientSession, url: str, prompt: str, a: argparse.Namespace, rec: Req,
                     opened: float) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": a.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    rec.start = start - opened
    status, error, done, finish, last, chunks = 0, "", False, None, start, 0
    try:
        async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as resp:
            status = resp.status
            if status != 200:
                error = (await resp.text())[:120]
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = error or f"SSE error: {event['error'].get('message')}"
                        for choice in event.get("choices") or []:
                            finish = choice.get("finish_reason") or finish
                            if choice.get("text"):
                                now = time.perf_counter()
                                if chunks:
                                    rec.itl.append(now - last)
                                else:
                                    rec.ttft = now - start
                                last, chunks = now, chunks + 1
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:  # ValueError: a chunk that is not JSON
        error = f"{type(e).__name__}: {e}"
    rec.error = failure(status, error, done, finish)
    rec.ok = not rec.error


async def client_loop(http: aiohttp.ClientSession, url: str, a: argparse.Namespace, tag: str, records: list[Req],
                      stop: asyncio.Event, opened: float) -> None:
    n = 0
    while not stop.is_set():
        rec = Req()
        records.append(rec)
        name = f"{tag}-{n}"
        await stream_one(http, url, f"Request {name}: " + text(a.prompt_words, zlib.crc32(name.encode())), a, rec,
                         opened)
        n += 1
        if not rec.ok:  # a router that refuses at once must not turn the loop into a spin
            await asyncio.sleep(0.1)


async def replace(stack: Stack, e: Engine, gen: int | None, events: list[dict[str, Any]], opened: float) -> None:
    """SIGTERM, wait for the exit; then (gen given) the engine of that generation on the same ports, healthy."""
    def mark(what: str, **extra: Any) -> None:
        events.append({"t": round(time.perf_counter() - opened, 3), "engine": e.name, "event": what, **extra})

    mark("SIGTERM")
    e.child.terminate()
    killed = await asyncio.to_thread(e.child.reap, time.monotonic() + stack.a.drain_seconds + 30)
    sweep(e.child)
    mark("exited", code=e.child.proc.returncode if e.child.proc else None, killed=killed)
    if gen is None:
        return
    e.gen = gen
    e.child.argv = e.argv(stack.mode, stack.a)
    e.child.start()
    await asyncio.to_thread(e.child.wait_healthy, stack.a.start_timeout)
    mark("healthy")


async def change(stack: Stack, scenario: str, events: list[dict[str, Any]], opened: float) -> None:
    if scenario == "rollout":
        for name in ROLLOUT_ORDER:
            await replace(stack, stack.engine(name), 1, events, opened)
    elif scenario == "scale-down":
        gone = (stack.engine("prefill-1"), stack.engine("decode-1"))
        await asyncio.gather(*(replace(stack, e, None, events, opened) for e in gone))


async def window(stack: Stack, scenario: str, http: aiohttp.ClientSession) -> dict[str, Any]:
    a = stack.a
    kv = KvCounters(stack.engines)
    await kv.poll(baseline=True)
    router_before = await asyncio.to_thread(metrics_text, stack.router.url)
    marks = {e.name: len(e.child.log()) for e in stack.engines}
    records: list[Req] = []
    events: list[dict[str, Any]] = []
    stop = asyncio.Event()
    opened = time.perf_counter() + a.lead
    tasks = [asyncio.create_task(client_loop(http, stack.router.url, a, f"{stack.mode}-{scenario}-{i}", records,
                                             stop, opened)) for i in range(a.concurrency)]
    follow = asyncio.create_task(kv.follow(stop))
    try:
        await asyncio.sleep(a.lead)
        await change(stack, scenario, events, opened)
        changed = time.perf_counter() - opened
        await asyncio.sleep(max(a.window, changed + a.settle) - (time.perf_counter() - opened))
        window_s = time.perf_counter() - opened
    finally:
        stop.set()
        await asyncio.gather(*tasks, follow)
    await kv.poll()
    router = await asyncio.to_thread(metrics_text, stack.router.url)
    logs = {e.name: e.child.log()[marks[e.name]:].splitlines() for e in stack.engines}
    drain = [f"{name}: {ln}" for name, lines in logs.items() for ln in lines if "[drain]" in ln]
    # A decode engine that cannot use the KV its prefill leg left (the block sizes differ, say) prefills the
    # request itself: the answer is whole, the prefill leg's work is lost.
    recomputed = sum("prefilling locally" in ln for e in stack.engines if e.role == "decode" for ln in logs[e.name])
    print(f"[{stack.mode} {scenario}] {len(records)} requests, {sum(not r.ok for r in records)} failed", flush=True)
    return {"window_s": window_s, "change_s": changed if scenario != "steady" else 0.0, "events": events,
            "summary": summarize(records, window_s), "kv": {**kv.totals(), "decode_prefilled_locally": recomputed},
            "drain_lines": drain,
            "router": {k: delta(by_label(router, *f), by_label(router_before, *f)) for k, f in ROUTER_FAMILIES.items()},
            "records": [{"t": round(r.start, 3), "ok": r.ok, "ttft_ms": round(r.ttft * 1000, 1),
                         "itl_max_ms": round(max(r.itl, default=0.0) * 1000, 1), "error": r.error} for r in records]}


async def warm_up(stack: Stack, http: aiohttp.ClientSession) -> None:
    """Three requests per loop, uncounted: every engine's first forwards and the NIXL handshakes."""
    n = 3 * stack.a.concurrency
    words = stack.a.prompt_words
    await asyncio.gather(*(stream_one(http, stack.router.url, f"Warm-up {stack.mode} {time.time()} {i}: "
                                      + text(words, i), stack.a, Req(), time.perf_counter()) for i in range(n)))


async def run(a: argparse.Namespace, logs: Path) -> dict[str, Any]:
    dirty = git("status", "--porcelain").splitlines()
    res: dict[str, Any] = {"uptime_before": os.getloadavg(), "head": git("rev-parse", "HEAD"),
                           "dirty_paths": [ln[3:] for ln in dirty], "modes": {}, "results": {}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for mode in a.modes:
            stack = Stack(mode, a, logs)
            try:
                res["modes"][mode] = {"commit": stack.commit, "tree": str(stack.tree),
                                      "imports": imported_from(stack.tree)}
                t = time.monotonic()
                await stack.up()
                res["modes"][mode]["revision_headers"] = await asyncio.to_thread(stack.revisions)
                prom = await asyncio.to_thread(metrics_text, stack.router.url)
                res["modes"][mode]["router_pairs_revisions"] = "tandem:router_revision_endpoints" in prom
                print(f"[{mode}] up in {time.monotonic() - t:.0f}s: {res['modes'][mode]}", flush=True)
                await warm_up(stack, http)
                res["results"][mode] = {}
                for scenario in a.scenarios:
                    if scenario != a.scenarios[0]:
                        await stack.reset()
                        await warm_up(stack, http)
                    res["results"][mode][scenario] = await window(stack, scenario, http)
                got = {s: r["summary"] for s, r in res["results"][mode].items()}
                for s, q in ratios(got).items():
                    res["results"][mode][s]["p99_over_steady"] = q
            finally:
                stop_all(stack.children())
                for c in stack.children():
                    sweep(c)
    res["uptime_after"] = os.getloadavg()
    return res


# -- report -------------------------------------------------------------------------------------------------

def table(res: dict[str, Any]) -> str:
    c, m = res["config"], res["modes"]
    dirty = res["dirty_paths"]
    code = sum(d.startswith("workers/") for d in dirty)

    def ms(v: float) -> str:
        return "n/a" if v != v else f"{v:.0f}"  # NaN: no request completed

    def x(v: float | None) -> str:
        return f" ({v:.2f}x)" if v else ""

    lines = [
        "# P/D membership changes under load: rollout and scale-down against no change, before and after",
        "",
        f"`{res['command']}` at {res['time']} on {describe(res['machine'])}; load average (1, 5, 15 min) "
        f"{', '.join(f'{v:.2f}' for v in res['uptime_before'])} before, "
        f"{', '.join(f'{v:.2f}' for v in res['uptime_after'])} after. HEAD {res['head'][:10]}"
        + (f" with {len(dirty)} paths changed in the working tree, {code} of them under workers/ (what `after` runs "
           "is HEAD plus those)" if dirty else "") + ".",
        "",
        "Modes: " + "; ".join(f"`{k}` = {v['commit'][:10]} run from {v['tree']} (engines' /health revisions "
                               f"{sorted(set(map(str, v['revision_headers'].values())))}, router pairs revisions: "
                               f"{v['router_pairs_revisions']})" for k, v in m.items())
        + ". A router (round-robin, health checks every "
        f"{c['health_interval']} s) in front of 2 prefill and 2 decode engines (float32, 1 thread each, unpinned); "
        f"{c['concurrency']} client loops send streamed completions (~{c['prompt_words']}-word prompts new to every "
        f"engine, {c['max_tokens']} tokens) back to back, from {c['lead']:.0f} s before the window. Rollout: block "
        "size 16 -> 32, each engine in turn (prefill-0, decode-0, prefill-1, decode-1) gets SIGTERM, exits, and its "
        "replacement starts on the same ports; capacity drops by one engine at a time, closer to a DrainFirst "
        "rollout than to a surge. Scale-down: prefill-1 and decode-1 get SIGTERM at once. Requests counted: those "
        "started in the window (failed whole run: lead and tail included). TTFT and ITL over completed requests. "
        f"The {res['machine']['cpus']} CPUs serve all five servers and the client: a starting engine's load and "
        "warm-up take CPU from the engines serving.",
        "",
        "| mode | scenario | window (s) | change took (s) | requests | failed (whole run) | TTFT p50 (ms) "
        "| TTFT p99 (ms) | TTFT max (ms) | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | KV loads failed "
        "| KV blocks received | decode prefilled itself | router migrations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, by in res["results"].items():
        for scenario, r in by.items():
            s, q = r["summary"], r.get("p99_over_steady") or {}
            kv = r["kv"]
            lines.append(
                f"| {mode} | {scenario} | {r['window_s']:.0f} | {r['change_s']:.0f} | {s['requests']} | "
                f"{s['failed']} ({s['failed_whole_run']}) | {ms(s['ttft_ms']['p50'])} | "
                f"{ms(s['ttft_ms']['p99'])}{x(q.get('ttft_ms'))} | {ms(s['ttft_ms']['max'])} | "
                f"{ms(s['itl_ms']['p50'])} | {ms(s['itl_ms']['p99'])}{x(q.get('itl_ms'))} | {ms(s['itl_ms']['max'])} | "
                f"{kv['kv_transfer_failures_total']:.0f} | "
                f"{kv['kv_transfer_received_blocks_total']:.0f} | {kv['decode_prefilled_locally']} | "
                f"{sum(r['router']['migrations'].values()):.0f} |")
    lines += ["", "(x) = p99 over the same mode's steady p99. KV loads failed and blocks received: the decode "
              "engines' counters, every process of the window. Decode prefilled itself: P/D requests whose decode "
              "engine could not use the KV of their prefill leg (its log's \"prefilling locally\"; block sizes "
              "16 and 32 across a rollout). Router migrations: requests the router resumed or replayed elsewhere. "
              "Failures by reason, the router's P/D decisions and the engines' `[drain]` lines are in "
              "pd_membership.json.", "", "![TTFT over time](pd_membership.png)", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    modes = list(res["results"])
    scenarios = [s for s in SCENARIOS if any(s in res["results"][m] for m in modes)]
    fig = Figure(figsize=(5.5 * len(modes), 3.2 * len(scenarios)))
    axes = fig.subplots(len(scenarios), len(modes), squeeze=False, sharey="row")
    for row, scenario in enumerate(scenarios):
        for col, mode in enumerate(modes):
            ax, r = axes[row][col], res["results"][mode].get(scenario)
            ax.set_title(f"{mode}: {scenario}", fontsize=10)
            if r is None:
                continue
            ok = [q for q in r["records"] if q["ok"]]
            bad = [q for q in r["records"] if not q["ok"]]
            ax.scatter([q["t"] for q in ok], [q["ttft_ms"] for q in ok], s=6, label="TTFT")
            top = max([q["ttft_ms"] for q in ok], default=1.0)
            ax.scatter([q["t"] for q in bad], [top] * len(bad), marker="x", color="red", label="failed")
            for ev in r["events"]:
                style = {"SIGTERM": ("red", ":"), "exited": ("gray", "-."), "healthy": ("green", "--")}[ev["event"]]
                ax.axvline(ev["t"], color=style[0], ls=style[1], lw=0.8)
            ax.axvspan(0, r["window_s"], color="0.93", zorder=0)
            ax.set_xlabel("s since the window opened (lines: SIGTERM, exit, new engine healthy)", fontsize=8)
            ax.set_ylabel("TTFT (ms)")
            if bad:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    # SIGTERM (`timeout`, `kill`) ends the run as Ctrl-C does: the finally blocks stop every server started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return bench_main("pd_membership", parse_args(), run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
