"""`tandem up` as a real process tree, with test upstreams standing in for engines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.router.utils import REPO, free_port

UPSTREAM = f"{sys.executable} -m tests.router.upstream"
TANDEM = [sys.executable, "-c", "import sys; from tandem_cli import main; sys.exit(main())"]


def run_up(args: list[str], log_dir: Path) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [*TANDEM, "up", "--log-dir", str(log_dir), "--engine-command", UPSTREAM, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"PYTHONPATH": f"{REPO}/workers:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "] ready in" in line:
            return proc, lines
    proc.kill()
    raise AssertionError("tandem up never got ready:\n" + "\n".join(lines))


def lines_url(lines: list[str], name: str) -> str:
    line = next(ln for ln in lines if f"starting {name} on " in ln)
    return line.split(" on ")[1].split(" ")[0]


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_up_runs_pd_stack_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    proc, lines = run_up(["--port", str(port), "--prefill", "1", "--decode", "1"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    assert any("ready in" in ln and url in ln for ln in lines)
    assert any("prefill-0 ready" in ln for ln in lines) and any("decode-0 ready" in ln for ln in lines)
    children = child_pids(proc.pid)
    assert len(children) == 3
    body = {"model": "m", "prompt": "a long enough prompt for remote prefill " * 20, "max_tokens": 2}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == " decode-0 decode-1"
    metrics = httpx.get(url + "/metrics").text
    assert 'tandem:router_pd_decisions_total{decision="remote"} 1.0' in metrics
    # A child that dies is restarted on its port, and the router re-admits it.
    decode_pid = next(int(ln.split("pid ")[1].split(",")[0]) for ln in lines if "starting decode-0" in ln)
    os.kill(decode_pid, signal.SIGKILL)
    assert proc.stdout is not None
    seen = []
    while not any("decode-0 ready again" in ln for ln in seen):
        seen.append(proc.stdout.readline())
    assert any("restarting decode-0 (1/5)" in ln for ln in seen)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").json()["decode"] != {lines_url(lines, "decode-0"): True}:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200
    children = child_pids(proc.pid)
    assert len(children) == 3
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "[up] stopped" in out
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
            "--engine-command",
            f"{sys.executable} -c 'import sys; print(\"boom: no model\"); sys.exit(3)'",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{REPO}/workers:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1
    assert "no prefill/decode roles yet" in proc.stdout
    assert "engine-0 exited with code 3" in proc.stdout and "boom: no model" in proc.stdout
