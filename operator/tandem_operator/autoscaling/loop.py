"""The planner at work (docs/architecture.md, "P/D autoscaling"): one loop per autoscaled InferenceService.

A kopf daemon runs `Autoscaler.run` while `spec.autoscaling` is set. Every `intervalSeconds` it reads the
ready pods of the router and engine Services from their EndpointSlices, scrapes each pod's `/metrics`,
turns this scrape and the previous one into `Signals`, asks the `Planner`, and acts on its plan:
`spec.<role>.replicas` (the field `kubectl scale` sets; the reconciler turns it into the Deployment's
replicas), one Kubernetes Event per scaling step, and `status.autoscaling` (the signals, the replicas
wanted, the last decision and why). A failed EndpointSlice read skips the tick; a pod that does not answer
is a missing pod, which the planner never reads as idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import kopf

from tandem_operator.autoscaling.planner import Decision, Plan, Planner, Replicas
from tandem_operator.autoscaling.signals import Scrape, Signals, parse_engine, parse_router, read_pods, signals
from tandem_operator.autoscaling.spec import DEFAULT_INTERVAL_SECONDS
from tandem_operator.kube import KubeClient, KubeError
from tandem_operator.naming import Component, workload_name
from tandem_operator.spec import InferenceServiceSpec, SpecError, parse_spec
from tandem_operator.status import now

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=3.0)


async def _text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=SCRAPE_TIMEOUT) as resp:
            return await resp.text() if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
        return None


async def _texts(session: aiohttp.ClientSession, pods: Mapping[str, str], port: int) -> dict[str, str | None]:
    """Pod name -> its `/metrics` text, or None when it did not answer."""
    texts = await asyncio.gather(*(_text(session, f"http://{ip}:{port}/metrics") for ip in pods.values()))
    return dict(zip(pods, texts, strict=True))


async def scrape(client: KubeClient, session: aiohttp.ClientSession, spec: InferenceServiceSpec) -> Scrape:
    """One round: every ready pod of the router and of each engine pool, at once."""
    ns = spec.namespace

    async def pods(role: Component) -> dict[str, str]:
        return await client.ready_endpoints(ns, workload_name(spec.name, role))

    roles = (Component.ROUTER, Component.DECODE, *((Component.PREFILL,) if spec.disaggregated else ()))
    # One after the other, in the caller's task (a few ms each): a list that fails, e.g. as the operator
    # exits and closes the API client, fails there, and leaves no task of its own behind to fail later.
    router, decode, *rest = [await pods(role) for role in roles]
    prefill = rest[0] if rest else None
    at = time.monotonic()
    texts = await asyncio.gather(_texts(session, router, spec.router.port), _texts(session, decode, spec.engine.port),
                                 _texts(session, prefill or {}, spec.engine.port))
    return Scrape(
        time=at,
        router=read_pods(texts[0], parse_router),
        decode=read_pods(texts[1], parse_engine),
        prefill=read_pods(texts[2], parse_engine) if prefill is not None else None,
    )


def replicas_patch(plan: Plan) -> dict[str, Any]:
    """The spec change a plan asks for (empty when nothing scales)."""
    return {d.role: {"replicas": d.desired} for d in plan.decisions if d.scaling}


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def deletion_costs(plan: Plan, scrape: Scrape) -> dict[str, dict[str, int]]:
    """Role -> pod -> `pod-deletion-cost` for each role the plan shrinks: the work a pod would have to finish
    before it could leave (requests running and waiting, and on prefill the KV blocks it holds for decode
    engines to read), so that the ReplicaSet removes the idlest. Pods whose scrape failed get none."""
    pools = {"decode": scrape.decode, "prefill": scrape.prefill or {}}
    return {
        d.role: {pod: round(s.running + s.waiting + s.held_blocks) for pod, s in pools[d.role].items() if s}
        for d in plan.decisions
        if d.scaling and d.desired < d.current
    }


def autoscaling_status(sig: Signals, plan: Plan, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """`status.autoscaling`: this tick's signals and plan; `lastScale` changes only when a role scales."""
    status: dict[str, Any] = {
        "lastScrapeTime": now(),
        "signals": sig.as_status(),
        "desiredReplicas": {d.role: d.desired for d in plan.decisions},
        "reasons": {d.role: d.reason for d in plan.decisions},
    }
    scaled = [d for d in plan.decisions if d.scaling]
    if scaled:
        status["lastScale"] = {"time": now(), "steps": [_step(d) for d in scaled]}
    elif previous and "lastScale" in previous:
        status["lastScale"] = previous["lastScale"]
    return status


def _step(d: Decision) -> dict[str, Any]:
    return {"role": d.role, "from": d.current, "to": d.desired, "reason": d.reason}


Tick = Callable[[aiohttp.ClientSession, kopf.Body], Awaitable[float]]


async def run_ticks(client: KubeClient, tick: Tick, body: kopf.Body, stopped: kopf.DaemonStopped) -> None:
    """A per-service daemon's loop: `tick` (which returns the seconds to the next one) until kopf stops it."""
    async with aiohttp.ClientSession() as session:
        while not stopped:
            try:
                interval = await tick(session, body)
            except Exception:
                if stopped or client.closed:  # the operator is exiting: its client closed under this tick
                    return
                raise
            await stopped.wait(interval)


class Autoscaler:
    """The loop of one InferenceService; its planner (and so its windows) lives as long as the loop."""

    def __init__(self, client: KubeClient, namespace: str, name: str) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.planner: Planner | None = None
        self.previous: Scrape | None = None

    async def run(self, body: kopf.Body, stopped: kopf.DaemonStopped) -> None:
        """Tick every `intervalSeconds` until kopf stops the daemon (autoscaling removed, or deleted)."""
        await run_ticks(self.client, self.tick, body, stopped)

    async def tick(self, session: aiohttp.ClientSession, body: kopf.Body) -> float:
        """One scrape, plan and action; returns the seconds until the next tick."""
        try:
            spec = parse_spec(dict(body))
        except SpecError:
            return DEFAULT_INTERVAL_SECONDS  # the reconciler reports the problems; nothing to plan with
        config = spec.autoscaling
        if config is None:
            return DEFAULT_INTERVAL_SECONDS
        if self.planner is None or self.planner.config != config:
            self.planner = Planner(config)  # a changed config starts afresh (windows seeded with the current size)
        try:
            now_scrape = await scrape(self.client, session, spec)
        except KubeError as exc:
            logger.warning("[autoscale] %s/%s: reading EndpointSlices failed: %s", self.namespace, self.name, exc)
            return float(config.interval_seconds)
        sig = signals(self.previous, now_scrape, config.targets.percentile)
        self.previous = now_scrape
        current = Replicas(decode=spec.decode.replicas,
                           prefill=spec.prefill.replicas if config.prefill is not None else None)
        plan = self.planner.plan(sig, current)
        await self.mark_deletion_costs(deletion_costs(plan, now_scrape))
        await self.act(body, plan, sig)
        return float(config.interval_seconds)

    async def mark_deletion_costs(self, costs: dict[str, dict[str, int]]) -> None:
        """Before a scale-down: Kubernetes picks which pods go, and removes those of lowest cost first (the
        annotation is read only then, so it is written only then)."""
        for role, pods in costs.items():
            for pod, cost in pods.items():
                try:
                    await self.client.patch("Pod", self.namespace, pod,
                                            {"metadata": {"annotations": {DELETION_COST: str(cost)}}})
                except KubeError as exc:  # gone since the scrape, or not ours to annotate: best effort
                    logger.warning("[autoscale] %s/%s: %s pod %s: %s", self.namespace, self.name, role, pod, exc)

    async def act(self, body: kopf.Body, plan: Plan, sig: Signals) -> None:
        change = replicas_patch(plan)
        if change:
            await self.client.patch_isvc(self.namespace, self.name, {"spec": change})
            for d in plan.decisions:
                if d.scaling:
                    reason = "ScaledUp" if d.desired > d.current else "ScaledDown"
                    kopf.event(body, type="Normal", reason=reason, message=d.reason[:1000])
                    logger.info("[autoscale] %s/%s %s", self.namespace, self.name, d.reason)
        previous = (body.get("status") or {}).get("autoscaling")
        try:
            await self.client.patch_isvc_status(self.namespace, self.name,
                                                {"autoscaling": autoscaling_status(sig, plan, previous)})
        except KubeError as exc:
            if exc.status != 404:
                raise
