"""A pod's status as kubelet computes it: container states, phase, and conditions with transition times."""

from __future__ import annotations

import datetime
import subprocess
from dataclasses import dataclass, field
from typing import Any

from tests.k8s.probes import Prober


def rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(eq=False)
class ContainerRun:
    """One container of the pod across its restarts: the running process, if any, and what to report."""

    spec: dict[str, Any]
    init: bool
    proc: subprocess.Popen[bytes] | None = None
    run_id: int = 0
    restart_count: int = 0
    env: dict[str, str] = field(default_factory=dict)
    started_mono: float = 0.0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    started: bool = False
    ready: bool = False
    succeeded: bool = False  # init containers: exited 0, never runs again
    stopping: bool = False
    probers: list[Prober] = field(default_factory=list)
    restart_at: float | None = None  # time.monotonic() of the next start; None: no start planned
    backoff_s: float = 0.0
    cpus: list[int] | None = None  # the CPUs its running process is pinned to (cpu_placement.py)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def container_id(self, pod_uid: str) -> str:
        return f"tandem://{pod_uid[:8]}-{self.name}-{self.run_id}"

    def render(self, pod_uid: str) -> dict[str, Any]:
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.run_id:
            status["containerID"] = self.container_id(pod_uid)
        return status


class PodStatus:
    def __init__(self, spec: dict[str, Any], host_ip: str) -> None:
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.host_ip = host_ip
        self.pod_ip = ""
        self.start_time = rfc3339()
        self.init: list[ContainerRun] = []
        self.main: list[ContainerRun] = []
        self.initialized = False
        self.waiting_message = ""
        self._transitions: dict[str, tuple[bool, str]] = {}

    def all(self) -> list[ContainerRun]:
        return [*self.init, *self.main]

    def set_waiting_message(self, message: str) -> None:
        """Why the pod cannot start yet (an unsupported or missing volume): on every container not yet created."""
        self.waiting_message = message
        for run in self.all():
            waiting = run.state.get("waiting")
            if waiting and waiting.get("reason") in ("ContainerCreating", "PodInitializing"):
                run.state = {"waiting": {"reason": waiting["reason"], **({"message": message} if message else {})}}

    def phase(self) -> str:
        """kubelet's getPhase: Pending until every container started, terminal once none will run again."""
        if not self.initialized:
            failed = any("terminated" in r.state and not r.succeeded for r in self.init)
            return "Failed" if failed else "Pending"
        waiting = running = stopped = succeeded = 0
        for run in self.main:
            if "running" in run.state:
                running += 1
            elif "terminated" in run.state:
                stopped += 1
                succeeded += run.state["terminated"]["exitCode"] == 0
            elif run.last_state:
                stopped += 1
            else:
                waiting += 1
        if waiting:
            return "Pending"
        if running or self.restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if self.restart_policy == "Never" else "Running"

    def _condition(self, kind: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != ok:
            self._transitions[kind] = (ok, rfc3339())
        condition: dict[str, Any] = {
            "type": kind, "status": "True" if ok else "False", "lastProbeTime": None,
            "lastTransitionTime": self._transitions[kind][1],
        }
        # Status is patched (strategic merge): null removes a reason left from when the condition was False.
        condition.update(reason=reason or None, message=message or None) if not ok else condition.update(
            reason=None, message=None)
        return condition

    def render(self, pod_uid: str) -> dict[str, Any]:
        phase = self.phase()
        unready = [r.name for r in self.main if not r.ready]
        incomplete = [r.name for r in self.init if not r.succeeded]
        if phase in ("Succeeded", "Failed"):
            reason, message = "PodCompleted", ""
        else:
            reason = "ContainersNotReady"
            message = self.waiting_message or f"containers with unready status: [{' '.join(unready)}]"
        conditions = [
            self._condition("PodReadyToStartContainers", bool(self.pod_ip)),
            self._condition("Initialized", self.initialized, "ContainersNotInitialized",
                            f"containers with incomplete status: [{' '.join(incomplete)}]"),
            self._condition("Ready", not unready, reason, message),
            self._condition("ContainersReady", not unready, reason, message),
            self._condition("PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}],
            "startTime": self.start_time,
            "containerStatuses": [r.render(pod_uid) for r in self.main],
        }
        if self.init:
            status["initContainerStatuses"] = [r.render(pod_uid) for r in self.init]
        if self.pod_ip:
            status["podIP"] = self.pod_ip
            status["podIPs"] = [{"ip": self.pod_ip}]
        return status
