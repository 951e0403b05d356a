"""The ports an engine pod binds: their numbers, their names on the pod and the Service, and collisions.

Data-parallel rank i of an engine serves its KV side channel on `sideChannelPort + i`, publishes KV
events on `kvEvents.port + 2i` and answers replay requests on `kvEvents.port + 2i + 1`
(docs/contracts.md, "KV events"; docs/crd-reference.md). Declaring every one of them on the container
and the Service lets EndpointSlices list them and NetworkPolicies name them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Port names are IANA service names: at most 15 characters. "kv-replay-63" is the longest we make.
MAX_RANKS = 64


@dataclass(frozen=True)
class EnginePorts:
    http: int
    side_channel: int | None  # None: no KV side channel
    kv_events: int  # 0: no KV events
    ranks: int  # data-parallel EngineCores behind one API server

    def spans(self) -> dict[str, range]:
        """The ports of each spec field, all ranks together, keyed by the field's path."""
        ranks = max(self.ranks, 1)  # a size below 1 is a problem of its own
        spans = {"spec.engine.port": range(self.http, self.http + 1)}
        if self.side_channel is not None:
            spans["spec.kvTransfer.sideChannelPort"] = range(self.side_channel, self.side_channel + ranks)
        if self.kv_events:
            spans["spec.engine.kvEvents.port"] = range(self.kv_events, self.kv_events + 2 * ranks)
        return spans

    def problems(self) -> list[str]:
        """Why these ports cannot all be bound: one past 65535, or two fields that overlap."""
        named = list(self.spans().items())
        problems = [
            f"{field}: ports {_span(ports)} run past 65535 (data-parallel size {self.ranks})"
            for field, ports in named
            if ports[-1] > 65535
        ]
        for i, (field, ports) in enumerate(named):
            for other, theirs in named[:i]:
                if ports.start < theirs.stop and theirs.start < ports.stop:
                    problems.append(f"{field}: ports {_span(ports)} overlap {other} ({_span(theirs)})")
        return problems

    def named(self) -> list[tuple[str, int]]:
        """(name, port) for the container and the Service: `http`, then per rank `kv-side`, `kv-events` and
        `kv-replay`, suffixed `-i` from rank 1 on so that rank 0 keeps the same names at any size."""
        ports = [("http", self.http)]
        for rank in range(self.ranks):
            suffix = f"-{rank}" if rank else ""
            if self.side_channel is not None:
                ports.append((f"kv-side{suffix}", self.side_channel + rank))
            if self.kv_events:
                ports.append((f"kv-events{suffix}", self.kv_events + 2 * rank))
                ports.append((f"kv-replay{suffix}", self.kv_events + 2 * rank + 1))
        return ports


def _span(ports: range) -> str:
    return str(ports.start) if len(ports) == 1 else f"{ports.start}-{ports[-1]}"
