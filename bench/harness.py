"""What the benchmark scripts share: the model, prompts of random words, and writing a result set to
bench/results/. Servers are started and stopped with tandem_router.procs, as the tests do."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa ".split()


def text(n_words: int, seed: int) -> str:
    """`n_words` random words, the same for the same seed."""
    return " ".join(np.random.default_rng(seed).choice(WORDS, n_words))


def write_results(name: str, res: dict[str, Any], table: str, plot: Callable[[dict[str, Any], Path], None]) -> None:
    """Print `res` and write bench/results/<name>.json, .md (`table`) and .png (`plot(res, path)`)."""
    print(json.dumps(res, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table)
    plot(res, RESULTS / f"{name}.png")
