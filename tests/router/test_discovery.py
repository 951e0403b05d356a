"""EndpointSlice discovery through the official client against KMock (an in-memory Kubernetes API)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from tests.router.utils import eventually

from tandem_router.discovery import parse_selector, selector_matches

try:  # the operator tests' emulator adds resourceVersions and resumable watches
    from tests.operator.kube_emulator import RealisticEmulator as Emulator
except ImportError:  # pragma: no cover
    Emulator = kmock.KubernetesEmulator

pytestmark = pytest.mark.kmock(cls=Emulator)

SLICES = "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices"
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
            "namespace": "ns",
            "labels": {ISVC: isvc, ROLE: role, "kubernetes.io/service-name": f"{isvc}-{role}"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": eps,
    }


@pytest.fixture
def kubeconfig(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    kmock.resources.load_bundled()
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: k\n"
        f"clusters:\n- name: k\n  cluster:\n    server: {str(kmock.url).rstrip('/')}\n"
        "users:\n- name: k\n  user:\n    token: t\n"
        "contexts:\n- name: k\n  context:\n    cluster: k\n    user: k\n"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return str(path)


def test_selector_parsing_and_matching() -> None:
    sel = parse_selector(f"{ISVC}=llm, {ROLE}==decode,present")
    assert sel == {ISVC: "llm", ROLE: "decode", "present": None}
    assert selector_matches(sel, {ISVC: "llm", ROLE: "decode", "present": ""})
    assert not selector_matches(sel, {ISVC: "llm", ROLE: "prefill", "present": ""})
    assert not selector_matches(sel, {ISVC: "llm", ROLE: "decode"})
    with pytest.raises(ValueError):
        parse_selector("a!=b")


async def test_endpointslices_are_watched_with_readiness(kmock: Any, kubeconfig: str, upstream, router) -> None:
    a = await upstream(name="a")
    b = await upstream(name="b")
    pa, pb = (int(u.url.rsplit(":", 1)[1]) for u in (a, b))
    await kmock.post(
        SLICES, json=endpoint_slice("llm-decode-1", "decode", pa, [("127.0.0.1", True), ("10.9.9.9", False)])
    )
    await kmock.post(SLICES, json=endpoint_slice("llm-prefill-1", "prefill", 9000, [("10.1.1.1", None)]))
    # Another InferenceService's slice: KMock ignores label selectors, the router must not.
    await kmock.post(SLICES, json=endpoint_slice("other-decode-1", "decode", 9000, [("10.2.2.2", True)], isvc="other"))
    r = await router(
        discovery="kubernetes",
        namespace="ns",
        kubeconfig=kubeconfig,
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
        await kmock.post(SLICES, json=endpoint_slice("llm-decode-2", "decode", pb, [("127.0.0.1", True)]))
        await eventually(lambda: set(decode.endpoints) == {a.url, b.url})
        await kmock.patch(
            f"{SLICES}/llm-decode-1",
            json={"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": False}}]},
        )
        await eventually(lambda: set(decode.endpoints) == {b.url})
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["choices"][0]["text"].startswith(" b-0")
        await kmock.delete(f"{SLICES}/llm-decode-2")
        await eventually(lambda: decode.endpoints == {})
        async with s.post(r.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
        # Terminating endpoints are not admitted either.
        await kmock.patch(
            f"{SLICES}/llm-decode-1",
            json={
                "endpoints": [
                    {"addresses": ["127.0.0.1"], "conditions": {"ready": True}},
                ]
            },
        )
        await eventually(lambda: set(decode.endpoints) == {a.url})
        await kmock.patch(
            f"{SLICES}/llm-decode-1",
            json={
                "endpoints": [
                    {"addresses": ["127.0.0.1"], "conditions": {"ready": True, "terminating": True}},
                ]
            },
        )
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
