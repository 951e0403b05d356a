"""`tandem up` as a real process tree, with test upstreams standing in for engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.router.engines import UpProcess
from tests.router.utils import REPO

from tandem_router.procs import TANDEM, free_port

# The stand-in engine takes `tandem serve`'s flags, --role and --kv-side-channel-port included.
UPSTREAM = f"{sys.executable} -m tests.router.upstream"
ENV = {"PYTHONPATH": f"{REPO}/workers:{REPO}", "PATH": "/usr/bin:/bin"}


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_up_runs_pd_stack_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    up = UpProcess(["--engine-command", UPSTREAM, "--port", str(port), "--prefill", "1", "--decode", "1"], tmp_path,
                   env=ENV)
    try:
        up.wait_for("] ready in", timeout=60)
        url = f"http://127.0.0.1:{port}"
        assert any("ready in" in ln and url in ln for ln in up.lines)
        assert any("prefill-0 ready" in ln for ln in up.lines) and any("decode-0 ready" in ln for ln in up.lines)
        children = child_pids(up.proc.pid)
        assert len(children) == 3
        body = {"model": "m", "prompt": "a long enough prompt for remote prefill " * 20, "max_tokens": 2}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == " decode-0 decode-1"
        metrics = httpx.get(url + "/metrics").text
        assert 'tandem:router_pd_decisions_total{decision="remote"} 1.0' in metrics
        # A child that dies is restarted on its port, and the router re-admits it.
        os.kill(up.pid_of("decode-0"), signal.SIGKILL)
        up.wait_for("decode-0 ready again", timeout=60)
        assert any("restarting decode-0 (1/5)" in ln for ln in up.lines)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").json()["decode"] != {up.url_of("decode-0"): True}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200
        children = child_pids(up.proc.pid)
        assert len(children) == 3
    finally:
        up.interrupt()
    assert up.proc.returncode == 0, up.text()
    assert "[up] stopped" in up.text()
    time.sleep(0.2)
    assert all(
        not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        for pid in children
    )
    assert {p.name for p in tmp_path.iterdir()} == {"prefill-0.log", "decode-0.log", "router.log"}


def test_up_reports_an_engine_that_dies_during_startup(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [
            *TANDEM,
            "up",
            "--log-dir",
            str(tmp_path),
            "--port",
            str(port),
            "--prefill",
            "0",
            "--engine-command",
            f"{sys.executable} -c 'import sys; print(\"boom: no model\"); sys.exit(3)'",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert proc.returncode == 1
    assert "0 prefill + 1 colocated engine(s)" in proc.stdout
    assert "engine-0 exited with code 3" in proc.stdout and "boom: no model" in proc.stdout
