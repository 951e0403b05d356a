"""What a pod worker writes to the API server, as kubelet does: the pod's status through the status
subresource (only when it changed), Events about the pod, and the final deletion with grace 0."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.k8s.kube import Kube
from tests.k8s.pod_status import rfc3339

logger = logging.getLogger(__name__)


class PodApi:
    def __init__(self, kube: Kube, node_name: str, namespace: str, name: str, uid: str) -> None:
        self.kube = kube
        self.node_name = node_name
        self.namespace, self.name, self.uid = namespace, name, uid
        self.path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        self._last_status: dict[str, Any] | None = None
        self._events_sent: set[tuple[str, str]] = set()

    def write_status(self, status: dict[str, Any]) -> bool:
        """Patch the status if it changed since the last write; False once the pod no longer exists."""
        if status == self._last_status:
            return True
        try:
            self.kube.patch(f"{self.path}/status", {"status": status})
            self._last_status = status
        except ApiException as e:
            if e.status == 404:
                return False
            logger.warning("[pod] %s/%s: status update failed: %s", self.namespace, self.name, e.reason)
        return True

    def event(self, reason: str, message: str, kind: str = "Normal", once: bool = False) -> None:
        """Record an Event on the pod; with `once`, a (reason, message) already recorded is not repeated."""
        key = (reason, message)
        if once and key in self._events_sent:
            return
        self._events_sent.add(key)
        now = rfc3339()
        body = {
            "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace, "name": self.name,
                               "uid": self.uid},
            "reason": reason, "message": message[:1024], "type": kind, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "kubelet", "host": self.node_name},
            "reportingComponent": "kubelet", "reportingInstance": self.node_name,
        }
        try:
            self.kube.post(f"/api/v1/namespaces/{self.namespace}/events", body)
        except ApiException as e:
            logger.debug("event %s for %s/%s not recorded: %s", reason, self.namespace, self.name, e.reason)

    def delete(self) -> None:
        """Delete the Pod object once its containers are gone (grace 0: nothing is left to wait for)."""
        try:
            self.kube.delete(self.path, {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiException as e:
            if e.status not in (404, 409):
                raise
