"""One pod's life on the test node, from sandbox to deletion, on its own thread: kubelet's pod worker.

Init containers run one at a time to completion, then every container starts; exits restart per
restartPolicy with a short backoff (1 s doubling to 10 s: this is for tests); probes decide started/ready and
a failing liveness or startup probe kills the container. On a deletionTimestamp each container gets its
preStop hook, SIGTERM, and SIGKILL once the grace period is over; then the pod is deleted with grace 0, as
kubelet does. Status goes through the status subresource whenever it changes.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.k8s import container_runtime, process
from tests.k8s.container_config import ConfigError, PodContext, container_argv, container_env, container_mounts
from tests.k8s.cpu_placement import CpuPlacer
from tests.k8s.kube import Kube
from tests.k8s.pod_api import PodApi
from tests.k8s.pod_network import PodNetwork, Sandbox
from tests.k8s.pod_status import ContainerRun, PodStatus, rfc3339
from tests.k8s.pod_volumes import PodVolumes, unsupported
from tests.k8s.probes import Prober, Target, run_handler
from tests.k8s.service_hosts import ServiceHosts

logger = logging.getLogger(__name__)

TICK_S = 0.5
MIN_GRACE_S = 2.0  # kubelet's minimum between SIGTERM and SIGKILL, whatever preStop used


@dataclass(frozen=True)
class NodeContext:
    """What every pod worker shares with the node agent."""

    kube: Kube
    node_name: str
    network: PodNetwork
    hosts: ServiceHosts
    work_dir: Path
    allocatable: Mapping[str, str]
    api_port: int
    base_env: Mapping[str, str]
    working_dir: str
    entrypoints: Mapping[str, list[str]]
    mount_points: container_runtime.MountPoints = field(default_factory=container_runtime.MountPoints)
    cpu_placer: CpuPlacer = field(default_factory=CpuPlacer)


class PodWorker:
    def __init__(self, node: NodeContext, pod: dict[str, Any]) -> None:
        self.node = node
        meta = pod["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.api = PodApi(node.kube, node.node_name, self.namespace, self.name, self.uid)
        self._pod = pod
        self.pod_dir = node.work_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        self.status = PodStatus(spec, node.network.host_ip)
        # Init containers start as soon as the sandbox is up; the others once every init container succeeded.
        self.status.init = [ContainerRun(c, init=True, restart_at=0.0) for c in spec.get("initContainers") or []]
        self.status.main = [ContainerRun(c, init=False) for c in spec["containers"]]
        if self.status.init:
            for run in self.status.main:
                run.state = {"waiting": {"reason": "PodInitializing"}}
        self.sandbox: Sandbox | None = None
        self.volume_dirs: dict[str, Path] | None = None
        self._terminating = False
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._gone = threading.Event()  # the Pod object no longer exists: kill at once
        self._halt = threading.Event()  # the agent stops: kill at once, touch nothing in the API
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def start(self) -> PodWorker:
        self._thread.start()
        return self

    def update(self, pod: dict[str, Any]) -> None:
        # A plain swap, no lock: the watch thread must never wait for a pod busy starting a container.
        self._pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone.set()
        self._wake.set()

    def halt(self) -> None:
        self._halt.set()
        self._wake.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def refresh_hosts(self) -> None:
        sandbox = self.sandbox
        if sandbox is None:
            return
        spec = self._pod["spec"]
        text = self.node.hosts.render(self.namespace, sandbox.ip, self._hostname(), spec.get("subdomain", ""))
        self.node.network.write_hosts(sandbox, text)

    def _hostname(self) -> str:
        return str(self._pod["spec"].get("hostname") or self.name)[:63]

    # -- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._lifecycle()
        except Exception:
            logger.exception("[pod] %s/%s: worker failed", self.namespace, self.name)
        finally:
            for run in self.status.all():
                self._stop_probers(run)
                if run.proc is not None:
                    process.stop(run.proc, grace_s=1.0)
                    self.node.cpu_placer.release(run.cpus)
                    run.cpus = None
            self._teardown()

    def _stopping(self) -> bool:
        return self._gone.is_set() or self._halt.is_set()

    def _lifecycle(self) -> None:
        self._report()
        problem = unsupported(self._pod)
        if problem:
            self.status.set_waiting_message(problem)
            self.api.event("FailedMount", problem, "Warning")
        elif not self._stopping():
            self.sandbox = self.node.network.create(self.uid)
            self.status.pod_ip = self.sandbox.ip
            self.refresh_hosts()
        while not self._stopping():
            with self._lock:
                now = time.monotonic()
                for run in self.status.all():
                    if run.proc is not None and run.proc.poll() is not None:
                        self._on_exit(run, now)
                if self._pod["metadata"].get("deletionTimestamp") and not self._terminating:
                    self._begin_termination()
                if self._terminating:
                    if not any(r.proc for r in self.status.all()):
                        self._report()
                        self.api.delete()
                        return
                elif not problem:
                    self._step()
            self._report()
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _step(self) -> None:
        now = time.monotonic()
        if self.volume_dirs is None:
            try:
                self.volume_dirs = PodVolumes(self.node.kube, self._context(), self.pod_dir / "volumes").prepare()
                self.status.set_waiting_message("")
            except ConfigError as e:  # a ConfigMap not there yet, say: kubelet retries, and so do we
                self.status.set_waiting_message(str(e))
                self.api.event("FailedMount", str(e), "Warning", once=True)
                return
        if not self.status.initialized:
            pending = next((r for r in self.status.init if not r.succeeded), None)
            if pending is None:
                self.status.initialized = True
                for run in self.status.main:
                    run.restart_at = now
            elif pending.proc is None and pending.restart_at is not None and now >= pending.restart_at:
                self._start(pending)
            if not self.status.initialized:
                return
        for run in self.status.main:
            if run.proc is None and run.restart_at is not None and now >= run.restart_at:
                self._start(run)
        if self.sandbox is not None and self.status.phase() in ("Succeeded", "Failed"):
            # A finished pod keeps its IP in status but, as with kubelet, loses its sandbox.
            self.node.network.destroy(self.uid)
            self.sandbox = None

    def _context(self) -> PodContext:
        return PodContext(self._pod, self.status.pod_ip, self.node.network.host_ip, self.node.allocatable,
                          self.node.network.host_ip, self.node.api_port)

    # -- containers ---------------------------------------------------------------------------------------

    def _start(self, run: ContainerRun) -> None:
        assert self.sandbox is not None and self.volume_dirs is not None
        spec = run.spec
        base = {**self.node.base_env, "HOSTNAME": self._hostname()}
        try:
            env = container_env(self.node.kube, self._context(), spec, base)
            argv = container_argv(spec, env, self.node.entrypoints)
            mounts = container_mounts(spec, self.volume_dirs, env)
        except ConfigError as e:
            run.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            run.restart_at = time.monotonic() + 2.0
            self.api.event("Failed", f"Error: {e}", "Warning", once=True)
            return
        if run.run_id:
            run.restart_count += 1
        run.run_id += 1
        run.env = env
        run.cpus = self.node.cpu_placer.place(spec)
        run.proc = container_runtime.start(
            self.sandbox.netns, self._hostname(), argv, env, mounts, self.node.working_dir, spec.get("workingDir", ""),
            self.log_path(run.name), self.node.mount_points, run.cpus,
        )
        run.started_mono = time.monotonic()
        run.state = {"running": {"startedAt": rfc3339()}}
        run.restart_at = None
        run.started = run.ready = False
        logger.info("[pod] %s/%s: started %s (pid %s)", self.namespace, self.name, run.name, run.proc.pid)
        self.api.event("Started", f"Started container {run.name}")
        post_start = (spec.get("lifecycle") or {}).get("postStart")
        if post_start:
            ok, message = run_handler(post_start, self._target(run), 30.0)
            if not ok:
                self.api.event("FailedPostStartHook", message, "Warning")
                self._kill(run, f"PostStartHook failed: {message}")
                return
        if run.init:
            return
        if spec.get("startupProbe"):
            self._add_prober(run, "startup")
        else:
            self._on_started(run)

    def _target(self, run: ContainerRun) -> Target:
        ports = {p["name"]: p["containerPort"] for p in run.spec.get("ports") or [] if p.get("name")}
        return Target(self.status.pod_ip, ports, run.env, run.proc.pid if run.proc else 0)

    def _add_prober(self, run: ContainerRun, kind: str) -> None:
        run_id = run.run_id

        def report(kind: str, ok: bool, message: str) -> None:
            self._on_probe(run, run_id, kind, ok, message)

        run.probers.append(Prober(kind, run.spec[f"{kind}Probe"], self._target(run), run.started_mono, report).start())

    def _on_started(self, run: ContainerRun) -> None:
        run.started = True
        for kind in ("readiness", "liveness"):
            if run.spec.get(f"{kind}Probe"):
                self._add_prober(run, kind)
        run.ready = not run.spec.get("readinessProbe")

    def _on_probe(self, run: ContainerRun, run_id: int, kind: str, ok: bool, message: str) -> None:
        with self._lock:
            if run.run_id != run_id or run.proc is None or run.stopping:
                return
            if not ok:
                self.api.event("Unhealthy", f"{kind.capitalize()} probe failed: {message}", "Warning")
            if kind == "startup":
                if ok:
                    self._on_started(run)
                else:
                    self._kill(run, f"Container {run.name} failed startup probe, will be restarted")
            elif kind == "readiness":
                run.ready = ok
            elif not ok:
                self._kill(run, f"Container {run.name} failed liveness probe, will be restarted")
        self._wake.set()

    def _kill(self, run: ContainerRun, why: str) -> None:
        grace = self._pod["spec"].get("terminationGracePeriodSeconds", 30)
        probe = run.spec.get("livenessProbe") or {}
        if "liveness" in why and probe.get("terminationGracePeriodSeconds") is not None:
            grace = probe["terminationGracePeriodSeconds"]
        self.api.event("Killing", why)
        self._stop_container(run, float(grace))

    def _stop_container(self, run: ContainerRun, grace_s: float) -> None:
        """preStop, SIGTERM, SIGKILL after the grace period: on a thread, the loop reaps the exit."""
        if run.proc is None or run.stopping:
            return
        run.stopping = True
        self._stop_probers(run)
        proc, target = run.proc, self._target(run)
        pre_stop = (run.spec.get("lifecycle") or {}).get("preStop")

        def stop() -> None:
            began = time.monotonic()
            if pre_stop:
                ok, message = run_handler(pre_stop, target, grace_s)
                if not ok:
                    self.api.event("FailedPreStopHook", f"PreStopHook failed: {message}", "Warning")
            process.stop(proc, grace_s=max(MIN_GRACE_S, grace_s - (time.monotonic() - began)))
            self._wake.set()

        threading.Thread(target=stop, name=f"stop-{run.name}", daemon=True).start()

    def _stop_probers(self, run: ContainerRun) -> None:
        for prober in run.probers:
            prober.stop()
        run.probers.clear()

    def _on_exit(self, run: ContainerRun, now: float) -> None:
        assert run.proc is not None
        code = run.proc.returncode
        run.proc = None
        self.node.cpu_placer.release(run.cpus)
        run.cpus = None
        run.stopping = False
        self._stop_probers(run)
        # A runtime reports death by signal N as exit code 128+N.
        code = 128 - code if code < 0 else code
        logger.info("[pod] %s/%s: %s exited with %s", self.namespace, self.name, run.name, code)
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": run.state.get("running", {}).get("startedAt"),
            "finishedAt": rfc3339(),
            "containerID": run.container_id(self.uid),
        }
        run.started = run.ready = False
        policy = self._pod["spec"].get("restartPolicy", "Always")
        if run.init:
            run.succeeded = code == 0
            restart = code != 0 and policy != "Never"
        else:
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if self._terminating or not restart:
            run.state = {"terminated": terminated}
            run.restart_at = None
            return
        # Backoff resets once a run lasted a while, as kubelet's does after it ran cleanly.
        run.backoff_s = 1.0 if now - run.started_mono > 10 else min(10.0, max(1.0, run.backoff_s * 2))
        run.restart_at = now + run.backoff_s
        run.last_state = {"terminated": terminated}
        run.state = {"waiting": {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {run.backoff_s:.0f}s restarting failed container={run.name} pod={self.name}",
        }}

    # -- deletion -----------------------------------------------------------------------------------------

    def _begin_termination(self) -> None:
        self._terminating = True
        meta, spec = self._pod["metadata"], self._pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        grace = spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace
        logger.info("[pod] %s/%s: terminating, grace %s s", self.namespace, self.name, grace)
        for run in self.status.all():
            run.restart_at = None
            if run.proc is not None:
                self.api.event("Killing", f"Stopping container {run.name}")
                self._stop_container(run, float(grace))

    def _teardown(self) -> None:
        self.node.network.destroy(self.uid)
        self.sandbox = None
        # The logs stay: tests print them when they fail.
        shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)

    # -- the API ------------------------------------------------------------------------------------------

    def log_path(self, container: str) -> Path:
        return self.pod_dir / f"{container}.log"

    def _report(self) -> None:
        if self._stopping():
            return
        with self._lock:
            status = self.status.render(self.uid)
        if not self.api.write_status(status):
            self._gone.set()
