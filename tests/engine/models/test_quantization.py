"""`--quantization int8`: the dynamic int8 linear against a float32 reference, and the whole model against
its dense self."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tandem_engine.kernels.gguf_matmul import GGUFLinear, load_gguf_kernel
from tandem_engine.models import llama
from tandem_engine.models.llama import DecoderLayer, LlamaForCausalLM
from tandem_engine.models.loader import pick_dtype
from tandem_engine.models.quantization import (
    INT8_DOT_FLAGS,
    Q8_0,
    Int8Linear,
    check_supported,
    int8_on_blocks,
    q8_0_blocks,
)
from tests.engine.utils import prompt_logits, tiny_config


def reference(x: torch.Tensor, layer: Int8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x @ dequantized(W).T + b, and the error bound of quantizing x: [rows, out] each.

    Row r of x is rounded to multiples of s_r = max|x_r| / 127, so none of its elements moves by more
    than s_r / 2, and no output of that row by more than s_r / 2 * sum_k |W[o, k]|; the integer sums
    are exact, so float32 rounding of the result is all that is left."""
    w, b = layer.dequantized()
    y = x @ w.T + (0 if b is None else b)
    step = x.abs().amax(-1, keepdim=True) / 127  # [rows, 1]
    return y, step / 2 * w.abs().sum(1) + 1e-5 * (1 + y.abs())


@pytest.mark.parametrize(("out_f", "in_f"), [(37, 53), (1, 7), (64, 96), (130, 17)])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_within_the_activation_rounding_of_its_reference(
        out_f: int, in_f: int, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(out_f * 1000 + in_f + rows)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)  # rows of unequal size
    b = torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(rows, in_f, generator=g) * 3
    layer = Int8Linear(w, b)
    got = layer(x)
    want, bound = reference(x, layer)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() - bound).max())
    # Not a dense matmul in disguise: the activations really were rounded.
    assert not torch.allclose(got, x @ w.T + (0 if b is None else b), atol=1e-5, rtol=0)


def test_weights_are_int8_per_output_channel() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(19, 23, generator=g) * torch.logspace(-3, 1, 19)[:, None]  # scales over 4 decades
    w[7] = 0  # an all-zero channel stays zero
    dq, _ = Int8Linear(w, None).dequantized()
    scale = w.abs().amax(1, keepdim=True) / 127  # [out, 1]
    assert ((dq - w).abs() <= scale / 2 * (1 + 1e-5) + 1e-12).all()
    levels = dq[scale[:, 0] > 0] / scale[scale[:, 0] > 0]
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)
    assert levels.round().abs().max() == 127 and (dq[7] == 0).all()  # each row reaches its scale


def random_model(family: str, seed: int) -> LlamaForCausalLM:
    """The tiny config of `family` with random weights: norms near 1, the rest N(0, 0.15^2)."""
    model = LlamaForCausalLM(tiny_config(family), torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * r if "norm" in name else 0.15 * r)
    return model.eval()


# The model's logits may move by this fraction of their RMS. Each int8 projection's output moves by
# ~1% of its RMS (a row rounded to steps of max|x| / 127, ~1/40 of its standard deviation at these
# widths, errs by step / sqrt(12) per element, and those errors add up in quadrature like the signal);
# 2 layers of 4 projections and the residual stream compound that to a few per cent: measured 0.037
# for both families. Greedy choices flip only at near-ties, which random 128-token logits have plenty of
# (measured agreement 0.93 and 0.97).
RELATIVE_RMS_BOUND = 0.05
MIN_TOP1_AGREEMENT = 0.85


AVX2_ONLY = {"sse2", "avx", "avx2", "fma", "f16c"}
ROUTES = {"blocks": AVX2_ONLY, "int_mm": AVX2_ONLY | {"amx_int8"}}


@pytest.fixture(params=sorted(ROUTES))
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of int8's two implementations, chosen as on an x86 CPU without and with an int8 dot product."""
    monkeypatch.setattr(llama, "cpu_flags", lambda: ROUTES[request.param])
    monkeypatch.setattr(llama.platform, "machine", lambda: "x86_64")
    return str(request.param)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q/k/v
def test_int8_model_logits_stay_close_to_dense(family: str, route: str, tmp_path: Path) -> None:
    dense, int8 = random_model(family, 0), random_model(family, 0)
    int8.quantize("int8", torch.device("cpu"), tmp_path)
    prompt = torch.randint(3, 128, (29,), generator=torch.Generator().manual_seed(2))
    ref, got = prompt_logits(dense, prompt), prompt_logits(int8, prompt)
    rel = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"{family} on {route}: logits off by {rel:.4f} of their RMS, top-1 agreement {agree:.3f}")
    assert 0 < rel <= RELATIVE_RMS_BOUND, rel
    assert agree >= MIN_TOP1_AGREEMENT, agree


def test_quantize_replaces_the_dense_projections(route: str, tmp_path: Path) -> None:
    model = random_model("llama", 1)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.quantize("int8", torch.device("cpu"), tmp_path)
    model.prepack(torch.device("cpu"))
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert sorted(layer.quantized) == ["down", "gate_up", "o", "qkv"] and layer.packed == {}
    kind = GGUFLinear if route == "blocks" else Int8Linear
    assert all(isinstance(q, kind) for q in layer.quantized.values())
    if route == "blocks":
        assert all(p.qtype == Q8_0 for q in layer.quantized.values() for p in cast(GGUFLinear, q).parts)
    assert all(w.numel() == 0 for w, _ in layer.projections().values())
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < dense_bytes / 2
    assert model.quantization == "int8" and model.embed_tokens.numel() == 128 * 64  # embeddings stay dense


def test_int8_is_refused_off_the_cpu_and_off_float32() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only"):
        check_supported("int8", f32, torch.device("cuda"))
    with pytest.raises(ValueError, match="--quantization int8 needs float32 activations"):
        LlamaForCausalLM(tiny_config("llama"), torch.bfloat16).quantize("int8", cpu, Path("/nonexistent"))
    check_supported("none", torch.bfloat16, torch.device("cuda"))
    check_supported("int8", f32, cpu)
    assert pick_dtype("auto", "int8") is f32  # whatever the CPU: fbgemm takes float32 activations


def test_int8_runs_on_blocks_only_on_an_x86_cpu_without_an_int8_dot_product() -> None:
    """torch's int8 matmul ran 20x slower than float32 on an AVX2-only EPYC: there int8 takes Q8_0 blocks and
    the GGUF kernels instead; with an int8 dot product (or off x86, or flags unread) it stays on torch's."""
    assert int8_on_blocks("x86_64", AVX2_ONLY)
    for fast in INT8_DOT_FLAGS:
        assert not int8_on_blocks("x86_64", AVX2_ONLY | {fast})
    assert not int8_on_blocks("aarch64", {"asimd"})
    assert not int8_on_blocks("x86_64", set())


@pytest.mark.parametrize(("out_f", "in_f"), [(3, 32), (37, 96), (64, 576)])
def test_q8_0_blocks_round_each_block_of_32_to_its_own_scale(out_f: int, in_f: int, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(out_f + in_f)
    # blocks of unequal size along a row: one scale per row would round the small blocks to nothing
    w = torch.randn(out_f, in_f, generator=g) * torch.logspace(-3, 1, in_f // 32).repeat_interleave(32)
    w[0, :32] = 0  # an all-zero block stays zero
    q = q8_0_blocks(w)
    assert q.qtype == Q8_0 and q.rows == out_f and q.cols == in_f and q.data.shape == (out_f, in_f // 32 * 34)
    dq = torch.from_numpy(dequantize(q.data.numpy(), GGMLQuantizationType.Q8_0)).view(out_f, in_f)
    step = w.view(out_f, -1, 32).abs().amax(-1, keepdim=True) / 127  # [out, blocks, 1]
    err = (dq.view(out_f, -1, 32) - w.view(out_f, -1, 32)).abs()
    # half a step, plus what storing the step as float16 moves the block's largest level by
    d16 = step.half().float()
    assert (err <= d16 / 2 + 127 * (d16 - step).abs() + 1e-9).all()
    assert (dq[0, :32] == 0).all()
    # the kernel reads the same blocks: its dequantization equals the gguf package's
    torch.testing.assert_close(load_gguf_kernel(tmp_path).dequantize(q), dq, atol=0, rtol=0)


def test_q8_0_blocks_refuse_a_width_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_blocks(torch.ones(4, 40))


def test_int8_logs_its_route(route: str, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level("INFO"):
        random_model("llama", 1).quantize("int8", torch.device("cpu"), tmp_path)
    assert ("Q8_0 blocks on the" in caplog.text) == (route == "blocks")
