"""Where the endpoints come from: a static list, or Kubernetes EndpointSlices watched by label selector.

The watch uses the official (synchronous) `kubernetes` client on one thread per pool: list, then watch
from the list's resourceVersion, re-listing after an error or an expired resourceVersion. Only endpoints
whose `conditions.ready` is not false (unset means ready) and that are not terminating are admitted.
Selectors are also applied on our side, so a server that ignores them cannot widen a pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from abc import ABC, abstractmethod
from typing import Any, Protocol

from tandem_router.config import RouterConfig
from tandem_router.pool import Pool

logger = logging.getLogger(__name__)


class DiscoveredPools(Protocol):
    """What discovery uses of the router: the pools it fills, and whether their endpoints start admitted."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def decode(self) -> Pool: ...
    @property
    def prefill(self) -> Pool: ...


class Discovery(ABC):
    @abstractmethod
    async def start(self, router: DiscoveredPools) -> None: ...

    async def stop(self) -> None:
        return None


class StaticDiscovery(Discovery):
    def __init__(self, decode_urls: list[str], prefill_urls: list[str]) -> None:
        self.decode_urls = decode_urls
        self.prefill_urls = prefill_urls

    async def start(self, router: DiscoveredPools) -> None:
        # Without active health checks nothing would ever admit them, so they start admitted.
        healthy = router.config.health_interval <= 0
        router.decode.set_urls(self.decode_urls, healthy=healthy)
        router.prefill.set_urls(self.prefill_urls, healthy=healthy)


def parse_selector(selector: str) -> dict[str, str | None]:
    """`a=b,c==d,e` -> {"a": "b", "c": "d", "e": None} (None: the label must exist)."""
    out: dict[str, str | None] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term or " in " in term or term.startswith("!"):
            raise ValueError(f"only equality selectors are supported, got {term!r}")
        key, sep, value = term.replace("==", "=").partition("=")
        out[key.strip()] = value.strip() if sep else None
    return out


def selector_matches(selector: dict[str, str | None], labels: dict[str, str] | None) -> bool:
    labels = labels or {}
    return all(k in labels and (v is None or labels[k] == v) for k, v in selector.items())


def slice_urls(obj: Any, port_name: str, default_port: int) -> list[str]:
    """Ready endpoint URLs of one EndpointSlice (a typed `V1EndpointSlice`)."""
    port = default_port
    ports = obj.ports or []
    named = [p for p in ports if p.name == port_name and p.port]
    if named:
        port = named[0].port
    elif len(ports) == 1 and ports[0].port:
        port = ports[0].port
    urls = []
    for ep in obj.endpoints or []:
        cond = ep.conditions
        if cond is not None and (cond.ready is False or cond.terminating is True):
            continue
        for addr in ep.addresses or []:
            host = f"[{addr}]" if ":" in addr else addr
            urls.append(f"http://{host}:{port}")
    return urls


class _SliceWatch:
    """One pool's EndpointSlices: list + watch on a thread, pushing the URL set to the event loop."""

    def __init__(self, owner: KubernetesDiscovery, pool: Pool, selector: str) -> None:
        self.owner = owner
        self.pool = pool
        self.selector = selector
        self.parsed = parse_selector(selector)
        self.slices: dict[str, list[str]] = {}
        self.thread = threading.Thread(target=self._run, name=f"endpointslices-{pool.role.value}", daemon=True)

    def _publish(self) -> None:
        if self.owner.stopping.is_set():
            return
        urls = sorted({u for us in self.slices.values() for u in us})
        assert self.owner.loop is not None
        # Ready per its EndpointSlice: admitted at once (a rollout's new pod must serve the moment the old one
        # leaves); its revision is unknown, so it is paired with no one, until its first health check (at once).
        self.owner.loop.call_soon_threadsafe(self.pool.set_urls, urls, True)

    def _apply(self, kind: str, obj: Any) -> None:
        name = obj.metadata.name
        if kind == "DELETED" or not selector_matches(self.parsed, obj.metadata.labels):
            self.slices.pop(name, None)
        else:
            self.slices[name] = slice_urls(obj, self.owner.config.port_name, self.owner.config.target_port)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        api = self.owner.api
        ns = self.owner.config.namespace
        backoff = 0.5
        while not self.owner.stopping.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(ns, label_selector=self.selector, _request_timeout=10)
                self.slices.clear()
                for item in listed.items:
                    self._apply("ADDED", item)
                self._publish()
                version = listed.metadata.resource_version if listed.metadata else None
                backoff = 0.5
                while not self.owner.stopping.is_set():
                    w = watch.Watch()  # type: ignore[no-untyped-call]
                    self.owner.watches.add(w)
                    kwargs: dict[str, Any] = {"label_selector": self.selector, "timeout_seconds": 60}
                    if version:
                        kwargs["resource_version"] = version
                    try:
                        for event in w.stream(  # type: ignore[no-untyped-call]
                            api.list_namespaced_endpoint_slice, ns, _request_timeout=75, **kwargs
                        ):
                            obj = event["object"]
                            if event["type"] == "ERROR" or not hasattr(obj, "metadata"):
                                raise RuntimeError(f"watch error: {obj}")
                            if event["type"] == "BOOKMARK":
                                continue
                            self._apply(event["type"], obj)
                            self._publish()
                            if obj.metadata.resource_version:
                                version = obj.metadata.resource_version
                    finally:
                        self.owner.watches.discard(w)
                    version = w.resource_version or version
            except ApiException as e:
                if self.owner.stopping.is_set():
                    return
                logger.warning(
                    "[discovery] EndpointSlice %s for %s failed: %s %s",
                    "watch",
                    self.selector,
                    e.status,
                    e.reason,
                )
            except Exception as e:  # the connection dropped, the server went away: re-list after a pause
                if self.owner.stopping.is_set():
                    return
                logger.warning("[discovery] EndpointSlice watch for %s failed: %s", self.selector, e)
            self.owner.stopping.wait(backoff)
            backoff = min(backoff * 2, 10.0)


class KubernetesDiscovery(Discovery):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.stopping = threading.Event()
        self.watches: set[Any] = set()
        self._watchers: list[_SliceWatch] = []
        self.api: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()

    def _load_client(self) -> Any:
        from kubernetes import client, config

        try:
            if self.config.kubeconfig:
                raise config.ConfigException("kubeconfig given")
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config(config_file=self.config.kubeconfig)  # type: ignore[no-untyped-call]
        return client.DiscoveryV1Api()

    async def start(self, router: DiscoveredPools) -> None:
        self.loop = asyncio.get_running_loop()
        self.api = await asyncio.to_thread(self._load_client)
        pairs = [(router.decode, self.config.decode_selector), (router.prefill, self.config.prefill_selector)]
        for pool, selector in pairs:
            if selector:
                w = _SliceWatch(self, pool, selector)
                self._watchers.append(w)
                w.thread.start()
        logger.info(
            "[discovery] watching EndpointSlices in %s: decode=%r prefill=%r",
            self.config.namespace,
            self.config.decode_selector,
            self.config.prefill_selector,
        )

    async def stop(self) -> None:
        self.stopping.set()
        for w in list(self.watches):
            w.stop()
        # A thread blocked in a watch read leaves at its next event or read timeout; it is a daemon and
        # publishes nothing once stopping is set, so shutdown does not wait long for it.
        for sw in self._watchers:
            await asyncio.to_thread(sw.thread.join, 0.5)


def make_discovery(config: RouterConfig) -> Discovery:
    if config.discovery == "static":
        return StaticDiscovery(config.decode_urls, config.prefill_urls)
    if config.discovery == "kubernetes":
        return KubernetesDiscovery(config)
    raise ValueError(f"unknown discovery {config.discovery!r} (static or kubernetes)")
