"""What an installed (not editable) package must carry: the worker image runs `pip install /src`, and the
engine compiles its C kernels at run time from sources it reads beside its modules."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_source_and_header_and_the_timing_model_ship_in_the_package() -> None:
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tandem_engine"]
    engine = ROOT / "workers" / "tandem_engine"
    sources = sorted(p.relative_to(engine) for p in engine.rglob("*") if p.suffix in (".c", ".h"))
    assert sources and {p.parent.name for p in sources} == {"kernels"}, "C kernels and their header live in kernels/"
    sources.append(Path("sim/timing_cpu.json"))  # `tandem sim`'s default timing model
    missing = [str(p) for p in sources if not any(p.match(g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data] tandem_engine: {missing}"
