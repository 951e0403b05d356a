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


# Skip reasons that name an instruction set or a CPU: the tests that ran or not depending on the machine CI got.
CPU_WORDS = ("amx", "avx", "vnni", "x86", "cpu", "f16c", "isa", "bf16", "arm", "aarch64")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What a green run covered on this CPU: the machine's CPU and features, and every skip grouped by its
    reason, those that depend on the CPU first (AMX, AVX-512, ... paths run only where the CPU has them)."""
    from tandem_engine.kernels.build import cpu_flags, cpu_id

    reasons: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    model = next((ln.split(":", 1)[1].strip() for ln in cpu_id().splitlines() if ln.startswith("model name")), "?")
    features = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    terminalreporter.section("CPU coverage")
    terminalreporter.write_line(f"CPU: {model}; {' '.join(features) or 'no AVX'}")
    ran = len(terminalreporter.stats.get("passed", [])) + len(terminalreporter.stats.get("failed", []))
    cpu = {r: n for r, n in reasons.items() if any(w in r.lower() for w in CPU_WORDS)}
    terminalreporter.write_line(f"{ran} tests ran; {sum(cpu.values())} skipped for this CPU, "
                                f"{sum(reasons.values()) - sum(cpu.values())} for other reasons:")
    for reason, n in sorted(reasons.items(), key=lambda kv: (kv[0] not in cpu, -kv[1])):
        terminalreporter.write_line(f"  {n:4d} {'[cpu] ' if reason in cpu else ''}{reason}")
