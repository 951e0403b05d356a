"""`tandem serve` from a complete cache on a read-only mount, as an engine pod starts from the cache baked
into the worker image: healthy and answering, with the kernel loaded and nothing rebuilt."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tandem_engine.prepare import prepare
from tandem_router.procs import tandem_child
from tests.engine.engine_server import MODEL

pytestmark = pytest.mark.slow


def _can_mount() -> bool:
    try:
        return os.geteuid() == 0 and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _can_mount(), reason="needs root and unshare for a read-only bind mount")
def test_serve_starts_from_a_read_only_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    prepare(MODEL, cache)
    server = tandem_child("serve", "serve", ["--model", MODEL, "--dtype", "float32", "--cache-dir", str(cache)],
                          tmp_path / "serve.log")
    # In a mount namespace of its own, the cache directory is bound onto itself read-only.
    remount = f'mount --bind "{cache}" "{cache}" && mount -o remount,bind,ro "{cache}" && exec "$@"'
    server.argv = ["unshare", "-m", "sh", "-c", remount, "sh", *server.argv]
    server.start()
    try:
        server.wait_healthy(600)
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text
    finally:
        server.stop()
    log = server.log()
    assert "built the model cache" not in log and "kernel" not in log.lower(), log[-2000:]
