"""The scheduler's waiting queue, in the order of `--scheduling-policy` (vLLM's two policies).

fcfs: arrival order; a preempted request goes back to the front. priority: lowest `priority` first,
then earliest arrival; a preempted request goes back in that order too (docs/operations.md,
"Overload: priorities and the waiting bound").
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from tandem_engine.config import SchedulingPolicy
from tandem_engine.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, req: Request) -> None:
        """A new request."""

    @abstractmethod
    def readd(self, req: Request) -> None:
        """A request that had started (preempted, or its remote KV failed): it keeps its place."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return what `peek` returns."""

    @abstractmethod
    def remove(self, req: Request) -> bool:
        """Remove `req` wherever it is; False when it was not queued."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests in the order they would be admitted."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def readd(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._q.remove(req)
        except ValueError:
            return False
        return True

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


def priority_key(req: Request) -> tuple[int, float]:
    """Lower is served first: vLLM's `priority`, then arrival."""
    return req.priority, req.arrival_time


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        # (priority, arrival, tie-breaker, request): the counter keeps equal keys in insertion order.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(req), next(self._counter), req))

    def readd(self, req: Request) -> None:
        self.add(req)  # its arrival time already places it ahead of later requests of its priority

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._heap)


def make_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
