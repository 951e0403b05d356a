"""The one module that imports `nixl`: a thin agent wrapper with exactly the calls the connector makes.

The worker side is unit-tested against an in-memory double of this class
(tests/engine/kv_transfer/test_nixl_worker.py); the real path runs end to end between two engine
processes. PyPI's `nixl` meta package pulls both CUDA builds, so the project depends on `nixl-cu12`
(import name `nixl_cu12`); `nixl` is tried first so an installed meta package or a source build also works.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import MutableMapping
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _api() -> Any:
    try:
        return importlib.import_module("nixl._api")
    except ImportError:
        return importlib.import_module("nixl_cu12._api")


# UCX's TCP transport moves an RMA read in segments of UCX_TCP_TX_SEG_SIZE (8 KiB by default): KV blocks
# between pods that only have TCP then crossed at 0.76 GB/s, half of what one TCP stream carries between the
# same two pods (bench/results/k8s_containers.md); 1 MiB segments carry them at about a TCP stream's rate.
# UCX refuses a receive segment smaller than the send segment, so both are set, and only if neither is.
UCX_TCP_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}


def ucx_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """UCX settings the engine changes from UCX's defaults, unless the user set them (UCX reads its
    environment when the backend is created)."""
    if not any(k in environ for k in UCX_TCP_SEGMENTS):
        environ.update(UCX_TCP_SEGMENTS)


class NixlWrapper:
    """One NIXL agent with the UCX backend. Handles are opaque to callers.

    `num_threads` > 0 gives UCX that many dedicated transfer threads, which split a large READ into
    chunks copied in parallel (on CPU each is a `process_vm_readv`); they block while no transfer is
    posted. `progress_ms` bounds how long the progress thread sleeps between UCX events."""

    def __init__(self, name: str, num_threads: int = 0, progress_ms: int = 100) -> None:
        api = _api()
        # STRICT: the connector's control thread adds remote agents while the engine thread polls.
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        self.name = name
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=[], sync_mode=sync))
        # nixl's Python agent hard-codes the progress thread's poll() timeout to 0, a busy spin that
        # burns a core for as long as the engine lives. The thread waits on UCX's event fds, so a
        # timeout only bounds the wake-up for events UCX does not signal. Swap in an agent configured
        # with one before the backend exists (the backend copies the setting when it is created).
        cfg = api.nixlBind.nixlAgentConfig()
        cfg.useProgThread, cfg.useListenThread, cfg.syncMode = True, False, sync.value
        cfg.pthrDelay, cfg.captureTelemetry = progress_ms * 1000, False
        self._agent.agent = api.nixlBind.nixlAgent(name, cfg)
        ucx_defaults()
        self._agent.create_backend("UCX", {"num_threads": str(num_threads)} if num_threads > 0 else {})
        self._regs: list[Any] = []

    def register(self, addr: int, nbytes: int, mem_type: str) -> None:
        """Register one region ("DRAM" or "VRAM") with the backend."""
        self._regs.append(self._agent.register_memory([(addr, nbytes, 0, "")], mem_type))

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def prep_descs(self, agent_name: str, descs: np.ndarray, mem_type: str) -> Any:
        """Prepare a descriptor list once; `descs` is `[n, 3]` int64 (addr, len, device id).
        `agent_name` "" means our own memory."""
        return self._agent.prep_xfer_dlist(agent_name or "NIXL_INIT_AGENT", descs, mem_type)

    def read(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> tuple[Any, str]:
        """Post a READ of remote descriptors into local ones; returns (handle, "DONE"|"PROC"|"ERR").
        A peer that is gone (NIXL_ERR_REMOTE_DISCONNECT and the like) is an "ERR", never an exception."""
        handle = None
        try:
            handle = self._agent.make_prepped_xfer("READ", local, local_idx, remote, remote_idx)
            return handle, str(self._agent.transfer(handle))
        except Exception as e:  # nixlBind raises typed errors per status code
            logger.warning("NIXL read failed to post: %s: %s", type(e).__name__, e)
            if handle is not None:
                self.release(handle)
            return None, "ERR"

    def check(self, handle: Any) -> str:
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception as e:
            logger.warning("NIXL transfer state: %s: %s", type(e).__name__, e)
            return "ERR"

    def release(self, handle: Any) -> bool:
        """Release a transfer handle; False when NIXL refused (a transfer it could not cancel)."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as e:  # nixlBind raises on an in-flight handle it cannot abort
            logger.warning("NIXL refused to release a transfer handle: %s", e)
            return False

    def close(self) -> None:
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                logger.debug("deregister failed: %s", e)
        self._regs.clear()
