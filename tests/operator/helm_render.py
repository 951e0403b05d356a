"""Lint and install the chart with a real Helm engine (helm-sdkpy) against the KMock apiserver.

Run as a subprocess by the tests (Helm's Go runtime stays out of pytest, and HELM_DRIVER=memory
must be in the environment before the library loads: KMock cannot store Helm's protobuf Secrets):

    HELM_DRIVER=memory python tests/operator/helm_render.py CHART [VALUES.yaml ...]
    HELM_DRIVER=memory python tests/operator/helm_render.py --server URL CHART

Prints one JSON document: the lint result, and per values file the release (manifest, notes) and
every object the install created in the emulator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import helm_sdkpy
import kmock
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from isvc_utils import prepare  # noqa: E402
from kube_emulator import RealisticEmulator  # noqa: E402

logger = logging.getLogger(__name__)
NAMESPACE = "tandem-system"
EMPTY_KUBECONFIG = "apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n"


def kubeconfig(url: str) -> str:
    return (
        f"apiVersion: v1\nkind: Config\ncurrent-context: kmock\nclusters:\n- name: kmock\n  cluster:\n"
        f"    server: {url}\nusers:\n- name: kmock\n  user:\n    token: test\ncontexts:\n- name: kmock\n"
        f"  context:\n    cluster: kmock\n    user: kmock\n    namespace: {NAMESPACE}\n"
    )


async def install(chart: str, values_file: str | None) -> dict[str, Any]:
    values = yaml.safe_load(Path(values_file).read_text()) if values_file else None
    async with RealisticEmulator() as emulator, kmock.Server(emulator) as server:
        prepare(emulator)
        config = helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig(str(server.url)))
        try:
            release = await helm_sdkpy.Install(config).run(
                "tandem", chart, values=values or None, wait=False, timeout=60
            )
            error = None
        except helm_sdkpy.HelmError as exc:
            release, error = {}, str(exc)
        objects = [obj.raw for obj in emulator.objects.values() if not obj.deleted]
    return {
        "values": values_file,
        "error": error,
        "manifest": release.get("manifest", ""),
        "hooks": [hook.get("manifest", "") for hook in release.get("hooks") or []],
        "notes": (release.get("info") or {}).get("notes", ""),
        "objects": objects,
    }


async def install_into(url: str, chart: str) -> int:
    """Install into a running apiserver (the tests' emulator); print the release."""
    config = helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig(url))
    release = await helm_sdkpy.Install(config).run("tandem", chart, wait=False, timeout=60)
    json.dump(
        {"manifest": release.get("manifest", ""), "notes": (release.get("info") or {}).get("notes")},
        sys.stdout,
    )
    return 0


async def main(argv: list[str]) -> int:
    if argv[0] == "--server":
        return await install_into(argv[1], argv[2])
    chart, values_files = argv[0], argv[1:]
    lint = await helm_sdkpy.Lint(helm_sdkpy.Configuration(kubeconfig=EMPTY_KUBECONFIG)).run(chart)
    installs = [await install(chart, None)] + [await install(chart, v) for v in values_files]
    json.dump({"lint": lint, "installs": installs}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
