"""How long a simulated engine's step takes: a linear model over what the scheduler put in the step, fitted
to the real engine's steps on this machine by bench/sim_calibrate.py (docs/simulation.md, "Timing model").

A step's time is c0 + c1 Tp + c2 Ap + c3 B + c4 C seconds, where Tp is the prompt tokens the step computes,
Ap their attention work (each token attends to every token before it: the sum of their positions), B the
decoding rows and C the tokens those rows attend to. Five numbers cover a prefill table, a decode grid
(batch x context) and the mixed steps of chunked prefill; a speed-up divides them all (a faster machine).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem_engine.scheduler_output import SchedulerOutput

FEATURES = ("steps", "prompt_tokens", "prompt_attention", "decode_rows", "decode_context")
DEFAULT_TIMING = Path(__file__).with_name("timing_cpu.json")


def step_features(sched: SchedulerOutput) -> tuple[float, float, float, float, float]:
    """(1, Tp, Ap, B, C) of a step: a row whose first token is past its prompt decodes, any other computes
    prompt tokens (a chunk of a prefill, or a resumed request's known tokens)."""
    tp = ap = b = c = 0.0
    for item in sched.scheduled:
        if item.start >= len(item.request.prompt_token_ids) and item.num_tokens == 1:
            b += 1
            c += item.start
        else:
            tp += item.num_tokens
            ap += item.num_tokens * (item.start + (item.num_tokens - 1) / 2)
    return 1.0, tp, ap, b, c


@dataclass(frozen=True)
class StepTiming:
    """The fitted coefficients (seconds per unit of each feature) and where they came from."""

    coefficients: tuple[float, float, float, float, float]
    machine: str = ""  # the CPU (or GPU) the real engine ran on
    model: str = ""
    source: str = ""  # what measured them (bench/sim_calibrate.py and its settings)

    def seconds(self, sched: SchedulerOutput, speedup: float = 1.0) -> float:
        x = step_features(sched)
        return sum(c * f for c, f in zip(self.coefficients, x, strict=True)) / speedup

    @classmethod
    def load(cls, path: Path = DEFAULT_TIMING) -> StepTiming:
        data = json.loads(Path(path).read_text())
        coefficients = tuple(float(data["coefficients"][name]) for name in FEATURES)
        if len(coefficients) != 5 or any(c < 0 for c in coefficients):
            raise ValueError(f"{path}: the coefficients of {', '.join(FEATURES)} must all be >= 0")
        return cls(coefficients, str(data.get("machine", "")), str(data.get("model", "")),
                   str(data.get("source", "")))

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["coefficients"] = dict(zip(FEATURES, self.coefficients, strict=True))
        return data
