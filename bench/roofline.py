"""What this machine can do for the serving workload: matmul rates measured at the model's own shapes, the
workload's FLOPs, and the fastest any engine could serve it here.

    .venv/bin/python bench/roofline.py [--batch 32 --input-len 256 --output-len 128]

Every engine computes the same projections for the same tokens (prompt tokens skip the LM head). The
floor is: prompt tokens at the best rate measured for prefill chunks of 512 (tandem's CPU step) and 2,048
rows, plus one decode step per output token at the measured rate for M = batch, each the best of torch's
matmuls (plain and oneDNN-packed), tandem's own
float32 panel kernel (kernels/panel_matmul.py), which is faster at decode shapes, and on a CPU with AMX
tandem's float32 AMX kernel over GGUF blocks (kernels/amx_matmul.py; float32 arithmetic on the tile unit,
measured on the weights quantized as the embedded model's file holds them: Q4_1, the head Q8_0): the
ceiling is what the fastest float32 matmul known here allows. Attention, norms and sampling are left out, so
the ceiling is generous.
`bench/serving.py` runs this first and reports both engines against the ceiling in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, quants

from tandem_engine.kernels.amx_matmul import AmxBlockLinear, AmxKernel, load_amx_kernel
from tandem_engine.kernels.gguf_matmul import QuantizedWeight
from tandem_engine.kernels.panel_matmul import PanelKernel, load_panel_kernel, pack_panels
from tandem_engine.models import packed_linear
from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model

MODEL = "smollm2-135m-instruct"
# The two ceilings, by how a FLOP is charged (keys "<dtype>, <kind>" of `ceiling_output_tok_s`).
EACH_SHAPE = "at each shape's rate"
BEST_RATE = "every FLOP at its best rate"


def shapes(cfg: Any) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """(per-layer projections as (out, in), LM head, layers): what one token multiplies through."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # fused QKV, O, fused gate/up, down
    return layer, (cfg.vocab_size, h), cfg.num_hidden_layers


def flops_per_token(cfg: Any) -> tuple[float, float]:
    """(prompt token, decode token): 2 FLOPs per weight; a prompt token skips the LM head."""
    layer, head, n = shapes(cfg)
    body = 2.0 * n * sum(o * k for o, k in layer)
    return body, body + 2.0 * head[0] * head[1]


def _time(fn: Any, min_s: float = 0.4) -> float:
    fn()
    ts: list[float] = []
    t_end = time.perf_counter() + min_s
    while len(ts) < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def rate(cfg: Any, m: int, dtype: torch.dtype, head: bool, packed: bool = False,
         panels: PanelKernel | None = None, amx: AmxKernel | None = None) -> float:
    """GFLOP/s of one layer's projections (and the LM head) for m tokens: weights as `nn.Linear` holds them,
    or (`packed`) reordered once into oneDNN's blocked layout, as tandem's model runner does for prefill, or
    (`panels`) in tandem's own float32 panels on that kernel, as its fused decode steps run them, or (`amx`)
    in Q4_1 blocks (the head Q8_0) on tandem's float32 AMX kernel."""
    layer, lm, _ = shapes(cfg)
    mats = [(o, k) for o, k in layer] + ([lm] if head else [])
    ws = [torch.randn(o, k, dtype=dtype) for o, k in mats]
    ps = [packed_linear.pack(w) if packed else None for w in ws]
    pn = [pack_panels(w) for w in ws] if panels else []
    qtypes = [GGMLQuantizationType.Q4_1] * len(layer) + [GGMLQuantizationType.Q8_0] * head
    am = [AmxBlockLinear([QuantizedWeight(int(t), torch.from_numpy(quants.quantize(w.numpy(), t)), w.shape[1])],
                         amx) for w, t in zip(ws, qtypes, strict=True)] if amx else []
    xs = {k: torch.randn(m, k, dtype=dtype) for _, k in mats}

    def run() -> None:
        if amx:
            for w, a in zip(ws, am, strict=True):
                a(xs[w.shape[1]])
            return
        if panels:
            for w, p in zip(ws, pn, strict=True):
                panels.matmul(xs[w.shape[1]], p, w.shape[0])
            return
        for w, p in zip(ws, ps, strict=True):
            packed_linear.linear(xs[w.shape[1]], w, None, p)

    flops = sum(2.0 * m * o * k for o, k in mats)
    return flops / _time(run) / 1e9


def int8_rate(cfg: Any, m: int) -> float | None:
    """The same for fbgemm's dynamic int8 linear (weights and activations in int8): for reference only."""
    try:
        layer, lm, _ = shapes(cfg)
        mats = [*layer, lm]
        warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
        packed = [torch.ops.quantized.linear_prepack(
            torch.quantize_per_tensor(torch.randn(o, k), 0.02, 0, torch.qint8), None) for o, k in mats]
        xs = {k: torch.randn(m, k) for _, k in mats}

        def run() -> None:
            for (_, k), p in zip(mats, packed, strict=True):
                torch.ops.quantized.linear_dynamic(xs[k], p)

        return sum(2.0 * m * o * k for o, k in mats) / _time(run) / 1e9
    except (RuntimeError, AttributeError):
        return None


# Prefill chunk sizes whose rates the prompt tokens take the best of: tandem's CPU step (512 tokens) and a
# larger one. On the AVX-512 Xeon tandem's float32 AMX kernel ran one layer's projections at ~556 GFLOP/s for
# 512 rows and ~500 for 2,048 (2026-12-06): with 2,048 alone the ceiling counted its prompt tokens ~10% slower
# than the kernel runs them.
PREFILL_CHUNKS = (512, 2048)


def measure(batch: int, input_len: int, output_len: int, prefill_chunks: tuple[int, ...] = PREFILL_CHUNKS,
            dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> dict[str, Any]:
    cfg, _, _ = load_config_and_tokenizer(resolve_model(MODEL))
    prompt_f, decode_f = flops_per_token(cfg)
    prompt_tokens, out_tokens = batch * input_len, batch * output_len
    total = prompt_tokens * prompt_f + out_tokens * decode_f
    res: dict[str, Any] = {
        "threads": torch.get_num_threads(), "batch": batch, "input_len": input_len, "output_len": output_len,
        "gflop_per_prompt_token": prompt_f / 1e9, "gflop_per_output_token": decode_f / 1e9,
        "workload_tflop": total / 1e12, "gflops": {}, "ceiling_output_tok_s": {}}
    sq = torch.randn(2048, 2048)
    # A fresh process's first second of matmuls ran at half speed (2026-12-04: 100 against 185 GFLOP/s a
    # minute later, oneDNN's kernels being generated and pages touched): warm up before measuring.
    _time(lambda: sq @ sq, min_s=1.0)
    res["gflops"]["float32 2048^3 (peak reference)"] = 2 * 2048**3 / _time(lambda: sq @ sq) / 1e9
    shapes_m = (*prefill_chunks, batch)
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        # (label, how rate() runs it) for each matmul measured at every shape
        ways: list[tuple[str, dict[str, Any]]] = [("", {})]
        if packed_linear.packing_supported(dt, torch.device("cpu")):
            ways.append(("oneDNN-packed ", {"packed": True}))
        kernel = load_panel_kernel(Path(tempfile.gettempdir()) / "tandem-roofline") if dt == torch.float32 else None
        if kernel is not None:
            ways.append(("tandem panels ", {"panels": kernel}))
        amx = load_amx_kernel(Path(tempfile.gettempdir()) / "tandem-roofline") if dt == torch.float32 else None
        if amx is not None:
            ways.append(("tandem AMX ", {"amx": amx}))
        rates = {(label, m): rate(cfg, m, dt, m == batch, **kw) for label, kw in ways for m in shapes_m}
        for (label, m), r in rates.items():
            res["gflops"][f"{name} {label}M={m}"] = r
        big = max(r for (_, m), r in rates.items() if m != batch)  # prompt tokens: any chunk size
        small = max(r for (_, m), r in rates.items() if m == batch)
        floor_s = prompt_tokens * prompt_f / (big * 1e9) + out_tokens * decode_f / (small * 1e9)
        res["ceiling_output_tok_s"][f"{name}, {EACH_SHAPE}"] = out_tokens / floor_s
        peak = max(v for k, v in res["gflops"].items() if k.startswith(name))
        res["ceiling_output_tok_s"][f"{name}, {BEST_RATE}"] = out_tokens / (total / (peak * 1e9))
    for m in shapes_m:
        r = int8_rate(cfg, m)
        if r is not None:
            res["gflops"][f"int8 dynamic (fbgemm) M={m}"] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    print(json.dumps(measure(a.batch, a.input_len, a.output_len), indent=1))


if __name__ == "__main__":
    main()
