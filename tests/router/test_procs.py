"""tandem_router.procs: Prometheus scraping that refuses unknown metrics, and a child's start/wait/stop."""

from __future__ import annotations

import signal
import socket
import sys
import threading
from pathlib import Path

import prometheus_client
import pytest
from tests.router.utils import start_upstream_process

from tandem_router.procs import Child, ChildExited, ephemeral_ports, free_port, free_port_pair, healthy, metric


def exposition() -> str:
    registry = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter("t:requests", "", ["outcome"], registry=registry)
    c.labels(outcome="200").inc(3)
    c.labels(outcome="500").inc()
    prometheus_client.Counter("t:failures", "", ["reason"], registry=registry)  # no sample yet
    prometheus_client.Histogram("t:latency_seconds", "", registry=registry).observe(0.5)
    return prometheus_client.generate_latest(registry).decode()


def test_metric_sums_matching_samples_and_refuses_a_metric_nothing_exports() -> None:
    text = exposition()
    assert metric(text, "t:requests_total") == 4.0
    assert metric(text, "t:requests_total", outcome="500") == 1.0
    assert metric(text, "t:requests_total", outcome="404") == 0.0  # declared, no such sample yet
    assert metric(text, "t:failures_total") == 0.0
    assert metric(text, "t:latency_seconds_sum") == 0.5 and metric(text, "t:latency_seconds_count") == 1.0
    for missing in ("t:request_total", "t:requests", "t:latency_seconds_max"):
        with pytest.raises(LookupError, match=missing):
            metric(text, missing)


def test_child_waits_for_health_and_stops_with_sigterm(tmp_path: Path) -> None:
    up = start_upstream_process(free_port(), "u", tmp_path)
    try:
        assert up.wait_healthy(30) > 0 and up.ready
    finally:
        assert up.stop() == -signal.SIGTERM
    assert not up.alive()


def test_child_that_exits_or_never_answers_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    dead = Child("dead", f"http://127.0.0.1:{free_port()}", [sys.executable, "-c", "print('boom'); exit(3)"],
                 tmp_path / "dead.log", die_with_parent=False).start()
    with pytest.raises(ChildExited, match="dead exited with code 3:\nboom"):
        dead.wait_healthy(30)
    mute = Child("mute", f"http://127.0.0.1:{free_port()}", [sys.executable, "-c", "import time; time.sleep(60)"],
                 tmp_path / "mute.log", die_with_parent=False).start()
    with pytest.raises(TimeoutError, match="mute not healthy"):
        mute.wait_healthy(0.5)
    mute.kill()
    assert mute.proc is not None and mute.proc.returncode == -signal.SIGKILL


def test_ports_come_from_below_the_ephemeral_range_bind_and_are_never_handed_out_twice(tmp_path: Path) -> None:
    """Outgoing connections and ZMQ binds to a wildcard port take ephemeral ports: a server's port drawn
    there could be taken before the server binds it (a pair could lose its second port)."""
    low, high = ephemeral_ports()
    handed: set[int] = set()
    for _ in range(20):
        port, single = free_port_pair(), free_port()
        assert 1024 <= port and port + 1 < low and 1024 <= single < low
        assert not {port, port + 1, single} & handed and single not in (port, port + 1)
        handed |= {port, port + 1, single}
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))
            c.bind(("127.0.0.1", single))
    assert low < high
    fixture = tmp_path / "ip_local_port_range"
    fixture.write_text("40000\t50000\n")
    assert ephemeral_ports(fixture) == (40000, 50000)
    assert ephemeral_ports(tmp_path / "missing") == (32768, 60999)


def test_a_port_answering_something_other_than_http_is_not_healthy() -> None:
    """An engine's port taken by another process's ZMQ socket answers a ZMQ greeting: waiting for the
    engine must go on (and end when it exits or times out), not raise from the HTTP parser."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def greet() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"\xff" + b"\x00" * 8 + b"\x01\x7f")  # ZMTP's signature
                conn.recv(1024)

        t = threading.Thread(target=greet)
        t.start()
        assert not healthy(f"http://127.0.0.1:{port}")
        t.join(5)
