"""`python -m tandem_engine.prepare`: a cache built ahead is one a start finds complete."""

from __future__ import annotations

import platform
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


def test_prepare_builds_every_kernel_a_start_loads(tmp_path: Path) -> None:
    """After prepare, an engine's start (dense or `--quantization gguf`) loads every C kernel from the cache:
    none is compiled again, so a baked read-only cache starts warm."""
    from tandem_engine.kernels.amx_matmul import build_amx_kernel
    from tandem_engine.kernels.build import try_build
    from tandem_engine.kernels.decode_step import load_decode_kernel
    from tandem_engine.kernels.fused import load_fused_ops
    from tandem_engine.kernels.gguf_matmul import load_gguf_kernel
    from tandem_engine.kernels.paged_attention import load_kernel
    from tandem_engine.kernels.panel_matmul import load_panel_kernel
    from tandem_engine.kernels.prefill_attention import load_kernel as load_prefill_kernel

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())
    cache = tmp_path / "cache"
    assert prepare.main(["--model", str(gguf), "--cache-dir", str(cache)]) == 0
    built = {p.name for p in (cache / "kernels").glob("*.so")}
    assert {name.split("_")[0] for name in built} >= {"paged", "prefill", "fused", "gguf", "panel"}
    assert any(n.startswith("gguf_matmul_") for n in built) and any(n.startswith("decode_step_") for n in built)
    if platform.machine() == "x86_64":  # built for nodes with AMX whatever this machine has
        assert any(n.startswith("amx_matmul_") for n in built)
    load_gguf_kernel.cache_clear()  # a start is a fresh process: nothing remembered from prepare
    load_panel_kernel.cache_clear()
    try_build.cache_clear()
    assert load_kernel(cache) is not None and load_prefill_kernel(cache) is not None
    assert load_fused_ops(cache).native
    assert load_decode_kernel(cache) is not None and load_panel_kernel(cache) is not None
    load_gguf_kernel(cache)
    if platform.machine() == "x86_64":
        assert build_amx_kernel(cache) is not None
    assert {p.name for p in (cache / "kernels").glob("*.so")} == built
