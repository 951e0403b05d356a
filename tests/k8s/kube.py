"""Plain-JSON calls to the apiserver (dicts in, dicts out) over the kubernetes client's TLS and connection pool.

The generated client validates every body into its models; a kubelet stand-in works on raw objects, spelled
as the API documents them (camelCase), so it calls the REST paths directly.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY"}  # as apiserver_request_total spells them


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api

    def _send(
        self, method: str, path: str, body: Any, query: Mapping[str, Any] | None, content_type: str,
        timeout_s: float,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = [(k, str(v).lower() if isinstance(v, bool) else v) for k, v in (query or {}).items()]
        request = self.api.param_serialize(method, path, query_params=params, header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        response = self.api.call_api(*request, _request_timeout=timeout_s)
        if not 200 <= response.status <= 299:
            data = response.read()
            raise ApiException.from_response(http_resp=response, body=data.decode(errors="replace"), data=None)
        return response

    def request(
        self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None,
        content_type: str = "application/json", timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        data = self._send(method, path, body, query, content_type, timeout_s).read()
        result: dict[str, Any] = json.loads(data) if data else {}
        return result

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return self.get(path)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def text(self, path: str) -> str:
        """A non-JSON endpoint, e.g. /metrics."""
        return str(self._send("GET", path, None, None, "application/json", 30.0).read().decode())

    def writes(self) -> dict[str, float]:
        """The API server's own count of write requests (apiserver_request_total), by "resource" or
        "resource/subresource", since it started."""
        out: dict[str, float] = {}
        for line in self.text("/metrics").splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if labels.get("verb") in WRITE_VERBS and labels.get("resource"):
                key = labels["resource"] + ("/" + labels["subresource"] if labels.get("subresource") else "")
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict[str, Any], content_type: str = STRATEGIC) -> dict[str, Any]:
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_s: int, **query: Any) -> Iterator[dict[str, Any]]:
        """Events from resource_version on, for at most timeout_s; an ERROR event (410 Gone) raises ApiException."""
        query = {**query, "watch": True, "resourceVersion": resource_version, "timeoutSeconds": timeout_s,
                 "allowWatchBookmarks": True}
        response = self._send("GET", path, None, query, "application/json", timeout_s + 10.0).response
        try:
            for line in response:
                if not line.strip():
                    continue
                event: dict[str, Any] = json.loads(line)
                if event["type"] == "ERROR":
                    status = event["object"]
                    raise ApiException(status=status.get("code", 500), reason=status.get("message", "watch error"))
                yield event
        finally:
            response.release_conn()
