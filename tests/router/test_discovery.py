"""EndpointSlice discovery through the official client against the real API server (tests/k8s).

The slices are written by hand (no Service or pods behind them, so the EndpointSlice controller leaves them
alone) and point at stub upstreams on the host's pod-network address: the server refuses loopback
addresses in EndpointSlices only for Endpoints, but a real slice never holds one. test_cluster_e2e.py
covers slices the controller makes for pods that serve.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from tests.k8s.cluster import Cluster
from tests.k8s.cluster import eventually as wait
from tests.router.utils import eventually

from tandem_router.discovery import parse_selector, selector_matches

NS = "discovery"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
ISVC = "serving.tandem.dev/inferenceservice"
ROLE = "serving.tandem.dev/role"


def endpoint_slice(
    name: str, role: str, port: int, endpoints: list[tuple[str, bool | None]], isvc: str = "llm"
) -> dict[str, Any]:
    eps = []
    for addr, ready in endpoints:
        ep: dict[str, Any] = {"addresses": [addr]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        eps.append(ep)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {ISVC: isvc, ROLE: role, "kubernetes.io/service-name": f"{isvc}-{role}"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": eps,
    }


class Slices:
    """Writes EndpointSlices off the event loop (the router under test watches from it)."""

    def __init__(self, cluster: Cluster) -> None:
        self.kube = cluster.kube

    async def post(self, body: dict[str, Any]) -> None:
        await asyncio.to_thread(self.kube.post, SLICES, body)

    async def patch(self, name: str, body: dict[str, Any]) -> None:
        await asyncio.to_thread(self.kube.patch, f"{SLICES}/{name}", body, "application/merge-patch+json")

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self.kube.delete, f"{SLICES}/{name}")


@pytest.fixture
def cluster(k8s_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    k8s_cluster.create_namespace(NS)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    try:
        yield k8s_cluster
    finally:
        k8s_cluster.kube.delete(f"/api/v1/namespaces/{NS}")
        # A later test's namespace of the same name must wait for this one to go.
        wait(lambda: k8s_cluster.kube.get_or_none(f"/api/v1/namespaces/{NS}") is None, 60, "namespace not deleted")


def test_selector_parsing_and_matching() -> None:
    sel = parse_selector(f"{ISVC}=llm, {ROLE}==decode,present")
    assert sel == {ISVC: "llm", ROLE: "decode", "present": None}
    assert selector_matches(sel, {ISVC: "llm", ROLE: "decode", "present": ""})
    assert not selector_matches(sel, {ISVC: "llm", ROLE: "prefill", "present": ""})
    assert not selector_matches(sel, {ISVC: "llm", ROLE: "decode"})
    with pytest.raises(ValueError):
        parse_selector("a!=b")


@pytest.mark.k8s
async def test_endpointslices_are_watched_with_readiness(cluster: Cluster, upstream, router) -> None:
    host = cluster.host_ip
    slices = Slices(cluster)
    a = await upstream(name="a", host=host)
    b = await upstream(name="b", host=host)
    pa, pb = (int(u.url.rsplit(":", 1)[1]) for u in (a, b))
    await slices.post(endpoint_slice("llm-decode-1", "decode", pa, [(host, True), ("10.9.9.9", False)]))
    await slices.post(endpoint_slice("llm-prefill-1", "prefill", 9000, [("10.1.1.1", None)]))
    # Another InferenceService's slice in the same namespace: the router's selector must leave it out.
    await slices.post(endpoint_slice("other-decode-1", "decode", 9000, [("10.2.2.2", True)], isvc="other"))
    r = await router(
        discovery="kubernetes",
        namespace=NS,
        kubeconfig=str(cluster.kubeconfig),
        decode_selector=f"{ISVC}=llm,{ROLE}=decode",
        prefill_selector=f"{ISVC}=llm,{ROLE}=prefill",
        remote_prefill_threshold=10_000,
    )
    decode, prefill = r.router.decode, r.router.prefill
    await eventually(lambda: set(decode.endpoints) == {a.url} and set(prefill.endpoints) == {"http://10.1.1.1:9000"})
    async with aiohttp.ClientSession() as s:
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["choices"][0]["text"].startswith(" a-0")
        # A second decode pod becomes ready (a new slice), then the first one turns unready.
        await slices.post(endpoint_slice("llm-decode-2", "decode", pb, [(host, True)]))
        await eventually(lambda: set(decode.endpoints) == {a.url, b.url})
        await slices.patch("llm-decode-1", {"endpoints": [{"addresses": [host], "conditions": {"ready": False}}]})
        await eventually(lambda: set(decode.endpoints) == {b.url})
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["choices"][0]["text"].startswith(" b-0")
        await slices.delete("llm-decode-2")
        await eventually(lambda: decode.endpoints == {})
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
        # Terminating endpoints are not admitted either.
        await slices.patch("llm-decode-1", {"endpoints": [{"addresses": [host], "conditions": {"ready": True}}]})
        await eventually(lambda: set(decode.endpoints) == {a.url})
        await slices.patch("llm-decode-1", {"endpoints": [{"addresses": [host], "conditions": {"ready": True,
                                                                                         "terminating": True}}]})
        await eventually(lambda: decode.endpoints == {})


def test_cli_selector_adds_the_role_per_pool() -> None:
    from tandem_router.cli import config_from_args

    c = config_from_args(
        [
            "--discovery",
            "kubernetes",
            "--namespace",
            "ns",
            "--selector",
            f"{ISVC}=llm",
            "--decode",
            "http://ignored:8000",
            "--policy",
            "prefix-aware",
        ]
    )
    assert c.decode_selector == f"{ISVC}=llm,{ROLE}=decode"
    assert c.prefill_selector == f"{ISVC}=llm,{ROLE}=prefill"
    assert (c.decode_policy, c.prefill_policy, c.namespace) == ("prefix-aware", "prefix-aware", "ns")
    with pytest.raises(SystemExit):
        config_from_args(["--discovery", "kubernetes"])


def test_cli_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem_router.cli import config_from_args

    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert config_from_args(["--decode", "http://a:1"]).api_key == "from-env"
    assert config_from_args(["--decode", "http://a:1", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("TANDEM_API_KEY")
    assert config_from_args(["--decode", "http://a:1"]).api_key is None
