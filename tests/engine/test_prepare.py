"""`python -m tandem_engine.prepare`: a cache built ahead is one a start finds complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem_engine import prepare
from tandem_engine.models import loader
from tests.engine.models.utils import tiny_weights, write_tiny_gguf


def test_prepare_builds_the_cache_a_start_reads(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())
    cache = tmp_path / "cache"
    assert prepare.main(["--model", str(gguf), "--cache-dir", str(cache), "--no-kernel"]) == 0
    (built,) = cache.glob("*/model/model.safetensors")
    assert loader.weights_dir(loader.resolve_model(str(gguf), cache)) == built.parent


def test_prepare_refuses_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare.main(["--model", str(tmp_path / "nope.gguf"), "--cache-dir", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err and not list(tmp_path.iterdir())
