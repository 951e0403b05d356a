"""Benchmark workloads: random prompts, shared-prefix multi-turn conversations, and the replay of a Mooncake
trace (trace.py).

There is no tokenizer here: prompts are made of common English words, about one token each, so
`--input-len` is approximate in tokens (a trace's prompts are token ids, exact). Every prompt is
deterministic for a given seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "good new first last long great little own other old big high different small large next early young "
    "important few public bad same able make know take see come think look want give use find tell ask seem "
    "feel try leave call keep let begin show hear play run move like live believe hold bring happen write "
    "provide sit stand lose pay meet include continue set learn lead understand watch follow stop create "
    "speak "
    "read allow add spend grow open walk win offer remember love consider appear buy wait serve die send "
    "expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Session:
    """One conversation: an optional system prompt and the user turns, sent one after another; or one
    request of a trace: a prompt of token ids, its own output length and when it arrives."""

    group: int
    system: str | None
    turns: list[str]
    token_prompt: list[int] | None = None  # sent as the completions prompt, instead of the turns' text
    output_len: int | None = None  # instead of --output-len
    arrival: float | None = None  # seconds after the start of the run


def random_sessions(num_prompts: int, input_len: int, seed: int, range_ratio: float = 0.0) -> list[Session]:
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        lo = max(1, int(input_len * (1 - range_ratio)))
        n = rng.randint(lo, input_len) if range_ratio > 0 else input_len
        out.append(Session(group=i, system=None, turns=[words(rng, n)]))
    return out


def shared_prefix_sessions(
    num_groups: int, users_per_group: int, turns: int, prefix_len: int, turn_len: int, seed: int
) -> list[Session]:
    """`num_groups` system prompts, each shared by `users_per_group` conversations of `turns` turns.
    Conversations are interleaved across groups, as concurrent users of different apps would be."""
    rng = random.Random(seed)
    systems = [f"[app {g}] " + words(rng, prefix_len) for g in range(num_groups)]
    by_group = [
        [
            Session(group=g, system=systems[g], turns=[words(rng, turn_len) for _ in range(turns)])
            for _ in range(users_per_group)
        ]
        for g in range(num_groups)
    ]
    order = [s for u in range(users_per_group) for g in range(num_groups) for s in [by_group[g][u]]]
    rng.shuffle(order)
    return order
