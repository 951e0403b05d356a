"""Suite-wide plugins: the real Kubernetes test cluster (tests/k8s) for any test that asks for `k8s_cluster`,
and a watchdog on the interpreter's exit."""

import faulthandler

import pytest

pytest_plugins = ["tests.k8s.fixtures"]

EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """pytest-timeout guards each test, not what runs after the summary: a non-daemon thread or a child a
    fixture left behind can keep the process alive until CI's limit. If the interpreter has not exited
    `EXIT_GRACE_S` after the run, every thread's stack is printed and the process exits non-zero."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
