"""Suite-wide plugins: the real Kubernetes test cluster (tests/k8s) for any test that asks for `k8s_cluster`,
and a watchdog on the interpreter's exit."""

import faulthandler
import os
import sys
import threading
import time

import pytest

pytest_plugins = ["tests.k8s.fixtures"]

EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """pytest-timeout guards each test, not what runs after the summary: a thread pool's worker stuck in a
    blocking call, a non-daemon thread or a child process a fixture left behind keeps the interpreter from
    exiting (it joins them), until CI's limit. If it has not exited `EXIT_GRACE_S` after the run, every
    thread's stack is printed, so that the leak can be found and fixed, and the process exits with the
    run's own status: the tests' verdict stands, the leak is reported, nothing waits for CI's limit."""
    status = int(getattr(config, "_tandem_exitstatus", 0))

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(f"\n[tests] the interpreter did not exit {EXIT_GRACE_S} s after the run; what holds "
                         f"it (a leak to fix):\n")
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._tandem_exitstatus = exitstatus  # type: ignore[attr-defined]
