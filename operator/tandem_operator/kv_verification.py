"""`KVTransferVerified`: whether KV actually moves from prefill to decode engines, from their own counters;
and `status.revisions`: which engine revisions serve, and their share of the requests.

A P/D service can look healthy while every prompt is prefilled again on decode, or while every KV load
fails. A daemon per InferenceService (`Verifier`) compares two scrapes a tick and writes what `judge` and
`revisions` make of them. The reasons: docs/crd-reference.md, "Status"; the loop: docs/architecture.md,
"P/D autoscaling".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from tandem_operator.autoscaling.loop import run_ticks, scrape
from tandem_operator.autoscaling.signals import RouterSample, Scrape, increase
from tandem_operator.autoscaling.spec import DEFAULT_INTERVAL_SECONDS
from tandem_operator.kube import KubeClient, KubeError
from tandem_operator.spec import SpecError, parse_spec
from tandem_operator.status import KV_CONDITION, kv_condition

logger = logging.getLogger(__name__)

FALLBACK_RATIO = 0.2
MIN_REMOTE = 2  # prompts through prefill with no block received before that counts (one may be a full cache hit)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    message: str


def judge(prev: Scrape | None, now: Scrape) -> Verdict | None:
    """The interval between two scrapes, judged; None when it says nothing (no prompt went remote or fell back)."""
    if prev is None or now.prefill is None:
        return None
    seconds = now.time - prev.time
    received = increase(prev.decode, now.decode, lambda s: s.kv_received_blocks)
    failures = increase(prev.decode, now.decode, lambda s: s.kv_failures)

    def decided(*names: str) -> float:
        return increase(prev.router, now.router, lambda s: s.decisions(*names))

    remote, fallback = decided("remote"), decided("local_fallback")
    no_prefill = decided("local_no_prefill", "local_no_prefill_of_revision")
    window = f"in the last {seconds:.0f} s"
    if failures:
        return Verdict(False, "TransferFailed", f"{failures:.0f} KV loads failed on decode engines {window} "
                       f"({received:.0f} blocks received): see the decode engines' logs ([handshake], [load])")
    if remote + fallback and fallback / (remote + fallback) > FALLBACK_RATIO:
        return Verdict(False, "PrefillFallingBack", f"{fallback:.0f} of {remote + fallback:.0f} prompts sent to "
                       f"prefill {window} were prefilled on decode instead (the prefill leg failed or returned no "
                       "kv_transfer_params): see the router's log")
    if no_prefill and not remote:
        return Verdict(False, "NoPrefillEngine", f"{no_prefill:.0f} long prompts {window} were prefilled on decode: "
                       "no prefill engine (of their revision) was up")
    if remote >= MIN_REMOTE and not received:
        return Verdict(False, "NoKVReceived", f"{remote:.0f} prompts went through a prefill engine {window}, but "
                       "decode engines received no KV block: they computed the prompts again")
    if received:
        return Verdict(True, "KVReceived", f"decode engines received {received:.0f} KV blocks from prefill "
                       f"engines {window} ({remote:.0f} prompts prefilled remotely)")
    return None


def revisions(prev: Scrape | None, now: Scrape) -> list[dict[str, Any]]:
    """`status.revisions`: each engine revision the routers admit, with its prefill and decode endpoints and
    its share of the requests routed in the interval (left out when none were); "" is an engine that sends
    no revision."""
    endpoints: dict[str, dict[str, int]] = {}
    for sample in now.router.values():
        for role, revision, n in sample.revision_endpoints if sample else ():
            roles = endpoints.setdefault(revision, {})
            roles[role] = max(roles.get(role, 0), int(n))  # every router replica sees every endpoint
    def requests_to(revision: str) -> Callable[[RouterSample], float]:
        return lambda s: sum(v for r, v in s.revision_requests if r == revision)

    sent = {rev: increase(prev.router if prev else None, now.router, requests_to(rev)) for rev in endpoints}
    total = sum(sent.values())
    out = []
    for revision, roles in sorted(endpoints.items()):
        if not any(roles.values()):
            continue
        entry: dict[str, Any] = {"revision": revision, "prefill": roles.get("prefill", 0),
                                 "decode": roles.get("decode", 0)}
        if total:
            entry["requestShare"] = round(sent[revision] / total, 2)
        out.append(entry)
    return out


class Verifier:
    """The loop of one P/D InferenceService, every autoscaling interval (15 s without autoscaling)."""

    def __init__(self, client: KubeClient, namespace: str, name: str) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.previous: Scrape | None = None

    async def run(self, body: kopf.Body, stopped: kopf.DaemonStopped) -> None:
        await run_ticks(self.client, self.tick, body, stopped)

    async def tick(self, session: aiohttp.ClientSession, body: kopf.Body) -> float:
        try:
            spec = parse_spec(dict(body))
        except SpecError:
            return DEFAULT_INTERVAL_SECONDS
        interval = float(spec.autoscaling.interval_seconds) if spec.autoscaling else DEFAULT_INTERVAL_SECONDS
        try:
            now = await scrape(self.client, session, spec)
        except KubeError as exc:
            logger.warning("[kv-verify] %s/%s: reading EndpointSlices failed: %s", self.namespace, self.name, exc)
            return interval
        verdict, serving = judge(self.previous, now), revisions(self.previous, now)
        self.previous = now
        if now.router and all(now.router.values()) and serving != (body.get("status") or {}).get("revisions"):
            await self.patch_status({"revisions": serving})
        if verdict is not None:
            await self.write(body, verdict, int((body.get("metadata") or {}).get("generation") or 0))
        return interval

    async def patch_status(self, status: dict[str, Any]) -> bool:
        try:
            await self.client.patch_isvc_status(self.namespace, self.name, status)
        except KubeError as exc:
            if exc.status != 404:
                raise
            return False
        return True

    async def write(self, body: kopf.Body, verdict: Verdict, generation: int) -> None:
        conditions: list[Mapping[str, Any]] = list((body.get("status") or {}).get("conditions") or [])
        old = next((c for c in conditions if c.get("type") == KV_CONDITION), None)
        new = kv_condition(verdict.ok, verdict.reason, verdict.message, generation, old)
        if old is not None and (old.get("status"), old.get("reason")) == (new["status"], new["reason"]):
            return  # the same judgement: no write (the message's figures change every interval)
        merged = [c for c in conditions if c.get("type") != KV_CONDITION] + [new]
        if not await self.patch_status({"conditions": merged}):
            return
        kopf.event(body, type="Normal" if verdict.ok else "Warning", reason=verdict.reason,
                   message=verdict.message[:1000])
        logger.info("[kv-verify] %s/%s %s=%s %s: %s", self.namespace, self.name, KV_CONDITION, new["status"],
                    verdict.reason, verdict.message)
