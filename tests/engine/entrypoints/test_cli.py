"""`tandem serve` flags: one per EngineConfig field, with the config's defaults, copied whole."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from tandem_engine.config import EngineConfig
from tandem_engine.entrypoints.cli import build_parser, config_from_args, main
from tandem_engine.models.llama import LlamaForCausalLM
from tandem_engine.models.loader import LoadedModel
from tandem_engine.worker.model_runner import ModelRunner, select_backend
from tests.engine.utils import tiny_config


def test_every_config_field_is_a_flag_with_the_configs_default() -> None:
    parser = build_parser()
    defaults = {a.dest: a.default for a in parser._actions}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in defaults, f"EngineConfig.{f.name} has no `tandem serve` flag"
        assert defaults[f.name] == getattr(EngineConfig(), f.name), f.name
    assert config_from_args(parser.parse_args([])) == EngineConfig()


def test_flags_reach_the_config() -> None:
    args = build_parser().parse_args([
        "--model", "/m", "--dtype", "float32", "--role", "decode", "--max-model-len", "512",
        "--num-kv-blocks", "8", "--no-prefix-caching", "--ready-timeout", "5", "--kv-failure-policy",
        "recompute", "--no-cpu-attention-kernel", "--no-cpu-fused-kernels", "--no-onednn-pack", "--no-cpu-amx-float32",
        "--no-cpu-float-panels", "--cache-dir", "/tmp/c",
        "--scheduling-policy", "priority", "--max-waiting-requests", "0", "--port", "9000",
        "--kv-cache-dtype", "bfloat16",
    ])
    config = config_from_args(args)
    assert config == dataclasses.replace(
        EngineConfig(), model="/m", dtype="float32", role="decode", max_model_len=512, num_kv_blocks=8,
        enable_prefix_caching=False, ready_timeout_s=5.0, kv_failure_policy="recompute",
        cpu_attention_kernel=False, cpu_fused_kernels=False, onednn_pack=False, cpu_amx_float32=False,
        cpu_float_panels=False, cache_dir="/tmp/c", scheduling_policy="priority",
        max_waiting_requests=0, kv_cache_dtype="bfloat16",
    )
    assert args.port == 9000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-waiting-requests", "-1"])
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):  # 0 would leave every request waiting
        with pytest.raises(SystemExit):
            build_parser().parse_args([flag, "0"])
        assert getattr(build_parser().parse_args([flag, "1"]), flag[2:].replace("-", "_")) == 1
    with pytest.raises(SystemExit, match="2"):
        build_parser().parse_args(["--kv-cache-dtype", "fp8"])


def test_quantization_flag_and_the_dtypes_it_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_from_args(build_parser().parse_args(["--quantization", "int8"])).quantization == "int8"
    assert EngineConfig(quantization="int8", dtype="float32").quantization_error() is None
    assert EngineConfig(quantization="none", dtype="bfloat16").quantization_error() is None
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(SystemExit) as e:
            main(["--quantization", "int8", "--dtype", dtype])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--quantization int8" in err and f"--dtype {dtype}" in err
    with pytest.raises(SystemExit) as e:
        main(["--quantization", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


def test_gguf_quantization_refuses_other_dtypes_models_and_tensor_types(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType

    from tests.engine.utils import write_gguf

    assert config_from_args(build_parser().parse_args(["--quantization", "gguf"])).quantization == "gguf"
    assert EngineConfig(quantization="gguf").quantization_error() is None
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "config.json").write_text("{}")
    (tmp_path / "st" / "model.safetensors").write_bytes(b"")
    norm = (np.ones(64, dtype=np.float32), GGMLQuantizationType.F32)
    write_gguf(tmp_path / "q5.gguf", "llama", {"output_norm.weight": norm, "blk.0.attn_q.weight": (
        np.zeros((64, 64), dtype=np.float32), GGMLQuantizationType.Q5_0)})
    for args, message in [
        (["--dtype", "bfloat16"], "--quantization gguf needs float32 activations around its matmuls: use "
                                  "--dtype float32 or auto, not --dtype bfloat16"),
        (["--model", str(tmp_path / "st")], f"--model {tmp_path / 'st'} is not a .gguf file"),
        (["--model", str(tmp_path / "q5.gguf")], "tensor(s) of other types: blk.0.attn_q.weight (Q5_0)"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["--quantization", "gguf", *args])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/var/cache/t")
    monkeypatch.setenv("TANDEM_SERVED_MODEL_NAME", "served")
    config = config_from_args(build_parser().parse_args([]))
    assert config.cache_dir == "/var/cache/t" and config.served_name == "served"
    assert config_from_args(build_parser().parse_args(["--cache-dir", "/x"])).cache_path == Path("/x")


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_cpu_attention_kernel_flag_and_cache_dir_reach_the_backend(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    off = select_backend(EngineConfig(cpu_attention_kernel=False, cache_dir=str(tmp_path)), cpu)
    assert off.name == "torch" and not (tmp_path / "kernels").exists()
    on = select_backend(EngineConfig(cache_dir=str(tmp_path)), cpu)
    assert on.name == "torch" and list((tmp_path / "kernels").glob("paged_attention_*.so"))


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_cpu_fused_kernels_flag_reaches_the_model(tmp_path: Path) -> None:
    cfg = tiny_config("llama")

    def runner(**flags: bool) -> ModelRunner:
        loaded = LoadedModel(LlamaForCausalLM(cfg, torch.float32), cfg, torch.float32)
        return ModelRunner(EngineConfig(num_kv_blocks=8, cache_dir=str(tmp_path), **flags), loaded, 16)

    assert not runner(cpu_fused_kernels=False).model.ops.native
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("fused_*.so"))
    assert runner().model.ops.native and list((tmp_path / "kernels").glob("fused_*.so"))
