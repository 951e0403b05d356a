"""A small in-test P/D proxy (docs/architecture.md, "The P/D request flow", steps 1-3) and helpers for
the P/D end-to-end tests.

`pd_completion` does what vLLM's toy proxy does: the request goes to prefill with `max_tokens=1`,
`stream=false`, no `min_tokens` and `kv_transfer_params` in the `RemoteDecodeParams` form; the returned
`kv_transfer_params` go to decode with the original request.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from tandem_engine.kv_transfer.messages import RemoteDecodeParams
from tandem_router.local_stack import split_cpus
from tandem_router.procs import free_port
from tests.engine.engine_server import Server, launch

MODEL = "smollm2-135m-instruct"


async def prefill(client: httpx.AsyncClient, p_url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """Step 1-2: the prefill leg; returns prefill's `kv_transfer_params` (None: it returned none)."""
    pre = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    pre.update(max_tokens=1, stream=False, kv_transfer_params=msgspec.to_builtins(RemoteDecodeParams()))
    r = await client.post(p_url + "/v1/completions", json=pre)
    r.raise_for_status()
    params: dict[str, Any] | None = r.json().get("kv_transfer_params")
    return params


async def pd_completion(client: httpx.AsyncClient, p_url: str, d_url: str, body: dict[str, Any]) -> httpx.Response:
    """Steps 1-3: prefill, then decode with the original request plus prefill's params."""
    params = await prefill(client, p_url, body)
    dec = dict(body)
    if params is not None:
        dec["kv_transfer_params"] = params
    return await client.post(d_url + "/v1/completions", json=dec)


def completion(prompt: str, max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **kw}


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until `cond()`; returns the seconds it took, raises AssertionError after `timeout_s`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s}s")
        time.sleep(0.1)
    return time.monotonic() - t0


def idle(server: Server) -> bool:
    return server.metric("vllm:kv_cache_usage_perc") == 0.0 and server.metric("vllm:num_requests_running") == 0


def freeze(server: Server) -> None:
    os.killpg(server.proc.pid, signal.SIGSTOP)


def kill(server: Server) -> None:
    server.kill()


def start_pair(log_dir: Path, lease_s: float, decode_args: list[str] | None = None,
               prefill_args: list[str] | None = None) -> tuple[Server, Server]:
    """Start a prefill and a decode `tandem serve` at once (start-up dominates these tests)."""
    servers = []
    shares = split_cpus(2)
    for i, (role, extra) in enumerate((("prefill", prefill_args or []), ("decode", decode_args or []))):
        servers.append(launch(log_dir, ["--role", role, "--kv-side-channel-port", str(free_port()),
                                        "--kv-lease-seconds", str(lease_s), "--max-num-seqs", "16", *extra],
                              cpus=shares[i]))
    for s in servers:
        s.wait_healthy(300)
    return servers[0], servers[1]



