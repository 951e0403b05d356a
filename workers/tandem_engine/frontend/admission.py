"""`--max-waiting-requests`: the API server refuses a request (HTTP 429) rather than let the EngineCores'
waiting queues grow without bound.

Counted in the API server, without a round trip: a request waits when more requests are in flight
(accepted, not finished) than the EngineCores can run at once (`--max-num-seqs` times the data-parallel
size). The EngineCores may run fewer when their KV cache is full, so the true waiting count can be
higher than this one; it is never lower (docs/operations.md, "Overload: priorities and the waiting
bound").
"""

from __future__ import annotations

from tandem_engine.frontend.interface import EngineOverloadedError

# What a refused client is told to wait before it retries (the Retry-After header, seconds): about
# the time a running request takes to free its slot at CPU decode speeds.
RETRY_AFTER_S = 1


class WaitingBound:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting

    def check(self, in_flight: int) -> None:
        """Raise EngineOverloadedError when `in_flight` requests (the new one included) would leave
        more than `max_waiting` of them waiting."""
        waiting = in_flight - self.max_running
        if waiting > self.max_waiting:
            raise EngineOverloadedError(
                f"The engine is overloaded: {self.max_waiting} request(s) are already waiting for one of its "
                f"{self.max_running} running slots (--max-waiting-requests); retry later",
                RETRY_AFTER_S,
            )
