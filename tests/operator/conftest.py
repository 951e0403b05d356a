"""Fixtures for the operator tests: a kubeconfig for the KMock apiserver and a clean kopf registry."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(autouse=True)
def _fresh_kopf_registry() -> Iterator[None]:
    """kopf's default registry is global: start every test with nothing registered (kmock.md pitfall 13)."""

    def reset() -> None:
        kopf.set_default_registry(None)  # type: ignore[arg-type]
        for name in [n for n in sys.modules if n == "tandem_operator.handlers"]:
            del sys.modules[name]

    reset()
    yield
    reset()


@pytest.fixture()
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Returns a function that points kopf and the operator's client at a server URL."""

    def point_at(url: str) -> Path:
        path = tmp_path / "kubeconfig"
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
            f"clusters:\n- name: kmock\n  cluster:\n    server: {url}\n"
            "users:\n- name: kmock\n  user:\n    token: test-token\n"
            "contexts:\n- name: kmock\n  context:\n    cluster: kmock\n    user: kmock\n"
        )
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        import kubernetes.config.kube_config as sync_kube_config

        # The sync client reads $KUBECONFIG once, at import time; kopf's login uses it.
        monkeypatch.setattr(sync_kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        return path

    return point_at
