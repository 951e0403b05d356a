"""Replay of a Mooncake trace (kvcache-ai/Mooncake, FAST25-release/traces; bench/data/mooncake/ holds the
conversation trace): one JSON line per request, `timestamp` (ms from the start), `input_length`,
`output_length` and `hash_ids`, one id per 512 prompt tokens, equal ids for equal blocks (a prefix tree).

Each hash id becomes its block of token ids, drawn from a generator seeded with the id, so requests that
share leading ids share leading tokens and a prefix cache sees the trace's reuse. Lengths and the block
may be scaled down (`length_scale`: a model of 8k context cannot take the trace's 12k-token mean) and time
sped up (`time_scale`); the trace's arrivals come in ticks of about 3 s, spread here over their tick.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tandem_router.bench.workload import Session

TRACE_BLOCK_TOKENS = 512  # tokens a hash id stands for in Mooncake's traces
TICK_S = 3.0  # the trace's timestamps come in steps of about this


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_trace(path: Path) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(TraceRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                    [int(h) for h in d["hash_ids"]]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Mooncake trace record ({e})") from None
    return out


@dataclass
class TraceWorkload:
    sessions: list[Session]
    dropped: int  # requests longer than max_model_len after scaling
    ideal_cached_share: float  # prompt tokens an infinite prefix cache would hold, over all prompt tokens


def trace_sessions(requests: list[TraceRequest], seed: int = 0, length_scale: float = 1.0,
                   time_scale: float = 1.0, token_range: tuple[int, int] = (1000, 30000),
                   max_model_len: int | None = None, max_requests: int | None = None) -> TraceWorkload:
    """The requests as sessions of one token-id prompt each, arriving at the trace's times divided by
    `time_scale`; a block of `512 * length_scale` tokens per hash id (ids drawn from `token_range`), prompt
    and output lengths scaled alike; those that would not fit `max_model_len` dropped."""
    block = max(1, round(TRACE_BLOCK_TOKENS * length_scale))
    rng = random.Random(seed)
    lo, hi = token_range
    sessions: list[Session] = []
    seen: set[int] = set()
    dropped = cached = total = 0
    for i, r in enumerate(requests):
        if max_requests is not None and len(sessions) == max_requests:
            break
        n_in = max(1, math.ceil(r.input_length * length_scale))
        n_out = max(1, round(r.output_length * length_scale))
        arrival = (r.timestamp_ms / 1000 + rng.uniform(0, TICK_S)) / time_scale
        if max_model_len is not None and n_in + n_out > max_model_len:
            dropped += 1
            continue
        prompt: list[int] = []
        for h in r.hash_ids:
            prompt += random.Random(f"{seed}:{h}").choices(range(lo, hi), k=block)
        prompt = prompt[:n_in]
        # The ideal: leading blocks seen before, as an infinite cache of this trace's blocks would hold them.
        lead = 0
        while lead < len(r.hash_ids) and r.hash_ids[lead] in seen:
            lead += 1
        cached += min(lead * block, n_in)
        total += n_in
        seen.update(r.hash_ids)
        sessions.append(Session(group=i, system=None, turns=[""], token_prompt=prompt, output_len=n_out,
                                arrival=arrival))
    sessions.sort(key=lambda s: s.arrival or 0.0)
    return TraceWorkload(sessions, dropped, cached / total if total else 0.0)
