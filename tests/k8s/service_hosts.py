"""Service names for pods without a DNS server: hosts-file lines built from EndpointSlices.

There is no kube-proxy, so a Service's ClusterIP routes nowhere; a name resolves to its ready endpoints' pod
IPs instead, as a headless Service's would. A Service in the pod's own namespace is also reachable by its
bare name (what the search path gives with cluster DNS); others need `<svc>.<ns>` or longer. Endpoints with
a hostname (StatefulSet pods of a headless Service) get `<hostname>.<svc>.<ns>.svc.cluster.local` too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

CLUSTER_DOMAIN = "cluster.local"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class ServiceHosts:
    def __init__(self) -> None:
        # (namespace, slice name) -> (service, [(ip, hostname or "")])
        self._slices: dict[tuple[str, str], tuple[str, list[tuple[str, str]]]] = {}
        self._lock = threading.Lock()

    def replace_all(self, slices: list[dict[str, Any]]) -> None:
        with self._lock:
            self._slices.clear()
            for obj in slices:
                self._put(obj)

    def update(self, event_type: str, obj: dict[str, Any]) -> None:
        with self._lock:
            if event_type == "DELETED":
                meta = obj["metadata"]
                self._slices.pop((meta["namespace"], meta["name"]), None)
            else:
                self._put(obj)

    def _put(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if not service or obj.get("addressType") != "IPv4":
            return
        endpoints = []
        for endpoint in obj.get("endpoints") or []:
            # Unset means ready (EndpointSlice API); publishNotReadyAddresses Services report ready anyway.
            if (endpoint.get("conditions") or {}).get("ready", True) is False:
                continue
            endpoints += [(address, endpoint.get("hostname") or "") for address in endpoint.get("addresses") or []]
        self._slices[(meta["namespace"], meta["name"])] = (service, endpoints)

    def render(self, namespace: str, pod_ip: str, hostname: str, subdomain: str = "") -> str:
        """The whole hosts file of one pod: localhost, the pod's own names, then every Service's endpoints."""
        own = [hostname]
        if subdomain:
            own.insert(0, f"{hostname}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}")
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{pod_ip}\t{' '.join(own)}"]
        names_by_ip: dict[str, list[str]] = {}
        with self._lock:
            entries = sorted((ns, svc, ip, host) for (ns, _), (svc, eps) in self._slices.items() for ip, host in eps)
        for ns, svc, ip, host in entries:
            fqdn = f"{svc}.{ns}.svc.{CLUSTER_DOMAIN}"
            names = [fqdn, f"{svc}.{ns}.svc", f"{svc}.{ns}"]
            if ns == namespace:
                names.append(svc)
            if host:
                names.insert(0, f"{host}.{fqdn}")
            bucket = names_by_ip.setdefault(ip, [])
            bucket += [n for n in names if n not in bucket]
        lines += [f"{ip}\t{' '.join(names)}" for ip, names in names_by_ip.items()]
        return "\n".join(lines) + "\n"
