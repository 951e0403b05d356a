"""Container probes and lifecycle hooks, run the way kubelet's prober does.

httpGet and tcpSocket go from the host to the pod IP (named ports resolved from the container's ports);
exec runs inside the container's namespaces with its environment. grpc probes are not supported and fail.
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.k8s import container_runtime

logger = logging.getLogger(__name__)

# The apiserver's defaults, for probe specs that did not pass through it.
DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1,
            "failureThreshold": 3}


@dataclass(frozen=True)
class Target:
    """What a handler acts on: one running container of one pod."""

    pod_ip: str
    ports: Mapping[str, int]
    env: Mapping[str, str]
    pid: int


def _port(value: int | str, target: Target) -> int:
    if isinstance(value, int) or value.isdigit():
        return int(value)
    if value not in target.ports:
        raise ValueError(f"no container port named {value!r}")
    return target.ports[value]


def run_handler(handler: dict[str, Any], target: Target, timeout_s: float) -> tuple[bool, str]:
    """Runs one probe or hook handler: (success, a message for events and logs)."""
    try:
        if "exec" in handler:
            argv = container_runtime.exec_argv(target.pid, handler["exec"]["command"])
            code, out = container_runtime.run(argv, target.env, timeout_s)
            if code is None:
                return False, f"command timed out after {timeout_s:.0f}s"
            return code == 0, f"exit code {code}: {out.strip()[-300:]}"
        if "httpGet" in handler:
            get = handler["httpGet"]
            host, port = get.get("host") or target.pod_ip, _port(get["port"], target)
            conn: http.client.HTTPConnection
            if get.get("scheme", "HTTP").upper() == "HTTPS":
                conn = http.client.HTTPSConnection(host, port, timeout=timeout_s,
                                                   context=ssl._create_unverified_context())
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
            headers = {"User-Agent": "kube-probe/tandem", "Accept": "*/*"}
            headers.update({h["name"]: h["value"] for h in get.get("httpHeaders") or []})
            try:
                conn.request("GET", get.get("path") or "/", headers=headers)
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP probe status {status}"
        if "tcpSocket" in handler:
            tcp = handler["tcpSocket"]
            with socket.create_connection((tcp.get("host") or target.pod_ip, _port(tcp["port"], target)), timeout_s):
                return True, "connected"
        if "sleep" in handler:
            time.sleep(min(float(handler["sleep"]["seconds"]), timeout_s))
            return True, "slept"
    except (OSError, ValueError, http.client.HTTPException) as e:
        return False, f"{type(e).__name__}: {e}"
    return False, f"unsupported handler {sorted(handler)}: the test node agent runs exec, httpGet, tcpSocket, sleep"


class Prober:
    """One probe (startup, readiness or liveness) of one container run, on its own thread.

    report(kind, success, message) is called each time the result flips after successThreshold or
    failureThreshold consecutive results, and for every further failure past the threshold. A startup
    probe stops after its success; a startup or liveness probe stops after reporting failure (the
    container is killed and its next run gets new probers).
    """

    def __init__(
        self, kind: str, spec: dict[str, Any], target: Target, started_mono: float,
        report: Callable[[str, bool, str], None],
    ) -> None:
        self.kind = kind
        self.spec = {**DEFAULTS, **spec}
        self.target = target
        self.started_mono = started_mono
        self.report = report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{kind}", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        spec = self.spec
        delay = self.started_mono + spec["initialDelaySeconds"] - time.monotonic()
        if delay > 0 and self._stop.wait(delay):
            return
        last: bool | None = None
        streak = 0
        reported: bool | None = None
        while not self._stop.is_set():
            began = time.monotonic()
            ok, message = run_handler(spec, self.target, float(spec["timeoutSeconds"]))
            if self._stop.is_set():
                return
            streak = streak + 1 if ok == last else 1
            last = ok
            threshold = spec["successThreshold"] if ok else spec["failureThreshold"]
            if streak >= threshold and (ok != reported or not ok):
                reported = ok
                self.report(self.kind, ok, message)
                if (ok and self.kind == "startup") or (not ok and self.kind in ("startup", "liveness")):
                    return
            self._stop.wait(max(0.0, began + spec["periodSeconds"] - time.monotonic()))
