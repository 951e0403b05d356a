"""Where one batched decode step's time goes, by component, run op by op with torch's norms and activation
(`torch`) and with the fused CPU kernels (`fused`), and as one C call (`one_call`: worker/decode_step.py on
its float32 matmuls), next to the float32 ceiling measured in the same run. With `--prefill`, one prefill
step instead: `--chunk` tokens of fresh `--context`-token prompts (each request ends at its first token, so
every timed step is prefill alone).

    .venv/bin/python bench/profile_step.py [--batch 32 --context 256 --steps 8]
    .venv/bin/python bench/profile_step.py --prefill [--chunk 512] --name profile_prefill

An EngineCore runs in-process (the real model, float32; no HTTP, no ZMQ): `--batch` requests with
`--context`-token prompts are prefilled, then `--steps` decode steps are timed for each variant, the two
variants alternating step by step so that both see the same load and about the same context. Explicit
timers around the model's projections, attention, KV writes, norms (with their residual adds), activation,
RoPE, LM head and sampler split each op-by-op step; what is left of the model's forward is the Python around
the layers, and what is left of the step the runner's and scheduler's Python. Inside the one C call the step
times its own phases (DecodeStep.phase_ns, as its first thread sees them, waits at barriers included):
q|k|v with RoPE and the cache writes and o, gate|up and down are `projections` (so `rope` and `kv_write` read
0 there), the attention and the copy of its output `attention`, the norms `norm_residual`, SiLU * up
`activation`. The ceiling is the step's
projection FLOPs at the matmul rate `bench/roofline.py` measures for M = the step's rows (its best layout,
tandem's float32 AMX kernel included where it runs, one layer's weights re-read from cache); the memory
floor is the bytes a step must stream (every weight
once, every sequence's K and V) at the rate a large tensor is summed. The attention kernel's KV read
rate is set against a copy of the same bytes of the pool.
Writes bench/results/profile_step.{json,md,png}, or `--name`'s (docs/benchmarks.md, "Decode step profile").
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

from tandem_engine.cpu_budget import openmp_env

os.environ.update(openmp_env())  # before torch loads libgomp, as for an EngineCore process

import torch  # noqa: E402
from harness import MODEL, bench_main, describe  # noqa: E402
from roofline import flops_per_token, rate, shapes  # noqa: E402

from tandem_engine.config import EngineConfig  # noqa: E402
from tandem_engine.core.engine_core import EngineCore  # noqa: E402
from tandem_engine.kernels.amx_matmul import AMX_F32_FROM_ROWS, amx_unfit, load_amx_kernel  # noqa: E402
from tandem_engine.kernels.decode_step import PHASES  # noqa: E402
from tandem_engine.kernels.fused import TORCH_OPS, FusedOps  # noqa: E402
from tandem_engine.kernels.panel_matmul import load_panel_kernel  # noqa: E402
from tandem_engine.models import llama  # noqa: E402
from tandem_engine.models.llama import DecoderLayer  # noqa: E402
from tandem_engine.models.loader import load_config_and_tokenizer, resolve_model  # noqa: E402
from tandem_engine.request import Request  # noqa: E402
from tandem_engine.sampling_params import SamplingParams  # noqa: E402
from tandem_engine.worker.decode_step import DecodeStep  # noqa: E402
from tandem_engine.worker.model_runner import ModelRunner

# Components timed inside the model's forward, then outside it (in the order of the table).
IN_FORWARD = ["projections", "attention", "kv_write", "norm_residual", "activation", "rope"]
OUTSIDE = ["lm_head", "sampling"]


class Timers:
    """Seconds and calls per component, charged to the variant being measured (None: not counted)."""

    def __init__(self) -> None:
        self.variant: str | None = None
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.kv_bytes: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.variant is not None:
                    self.seconds[self.variant][name] += time.perf_counter() - t0
        return timed


def instrument(core: EngineCore, timers: Timers, variants: dict[str, FusedOps]) -> None:
    """Put the timers around every component of `core`'s decode step."""
    runner, model = core.runner, core.runner.model
    # Every projection of a layer (dense, packed or quantized) goes through DecoderLayer._project.
    llama.DecoderLayer._project = timers.wrap("projections", llama.DecoderLayer._project)  # type: ignore[method-assign]
    backend = runner.backend
    kv = runner.kv_pool
    per_token = 2 * runner.num_kv_heads * runner.head_dim * kv.element_size()  # K and V of one layer
    attend = timers.wrap("attention", backend.forward)

    def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                  scale: float) -> torch.Tensor:
        if timers.variant is not None:
            timers.kv_bytes[timers.variant] += per_token * sum(meta.seq_lens_cpu)
        out: torch.Tensor = attend(query, k_cache, v_cache, meta, scale)
        return out

    backend.forward = attention  # type: ignore[method-assign]
    one_call = DecodeStep.__call__

    def fused_step(step: DecodeStep, x: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                   meta: Any) -> torch.Tensor:
        if timers.variant is not None:  # every layer's attention reads every row's K and V
            timers.kv_bytes[timers.variant] += per_token * sum(meta.seq_lens_cpu) * len(kv_caches)
        return one_call(step, x, positions, kv_caches, meta)

    DecodeStep.__call__ = fused_step  # type: ignore[method-assign]
    backend.write_kv = timers.wrap("kv_write", backend.write_kv)  # type: ignore[method-assign]
    for ops in {id(o): o for o in variants.values()}.values():
        ops.add_rms_norm = timers.wrap("norm_residual", ops.add_rms_norm)  # type: ignore[method-assign]
        ops.silu_mul = timers.wrap("activation", ops.silu_mul)  # type: ignore[method-assign]
        ops.rope = timers.wrap("rope", ops.rope)  # type: ignore[method-assign]
    model.forward = timers.wrap("forward", model.forward)  # type: ignore[method-assign]
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)  # type: ignore[method-assign]
    runner.sampler = timers.wrap("sampling", runner.sampler)  # type: ignore[assignment]


# The one C call's phases (decode_step.PHASES) charged to the components of the table.
PHASE_COMPONENTS = {"qkv_rope_kv_write": "projections", "o": "projections", "gate_up": "projections",
                    "down": "projections", "attention": "attention", "attention_out": "attention",
                    "norm_residual": "norm_residual", "activation": "activation"}


class Variant(NamedTuple):
    ops: FusedOps
    step: DecodeStep | None  # the model's fused decode step, or None: op by op


def decode_steps(core: EngineCore, a: argparse.Namespace, timers: Timers,
                 variants: dict[str, Variant]) -> dict[str, list[float]]:
    """Prefill the batch, then time `a.steps` decode steps per variant, alternating; seconds per step."""
    rng = random.Random(0)
    # Requests whose prefill ends early decode while later ones prefill (one token per step, at most
    # `batch` such steps): budget for them too, so that every timed step decodes the whole batch.
    max_tokens = 2 + len(variants) * a.steps + 2 + a.batch
    for i in range(a.batch):
        prompt = [rng.randrange(100, 40000) for _ in range(a.context)]
        core.add_request(Request(f"p{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 ignore_eos=True), [0]))
    started: set[str] = set()
    while len(started) < a.batch:  # prefill, in chunks of max_num_batched_tokens
        started.update(o.request_id for o in core.step())
    for _ in range(2):  # warm: the first decode steps build plans and buffers
        core.step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(len(variants) * a.steps):
        name = list(variants)[i % len(variants)]
        core.runner.model.use_fused_ops(variants[name].ops)
        step = core.runner.model.decode_step = variants[name].step
        before = None if step is None else step.phase_ns.clone()
        timers.variant = name
        t0 = time.perf_counter()
        outs = core.step()
        times[name].append(time.perf_counter() - t0)
        timers.variant = None
        if step is not None and before is not None:
            for phase, ns in zip(PHASES, (step.phase_ns - before).tolist(), strict=True):
                timers.seconds[name][PHASE_COMPONENTS[phase]] += ns / 1e9
        if sum(len(o.new_token_ids) for o in outs) != a.batch:
            raise RuntimeError("a timed step did not decode the whole batch (requests ended or were preempted: "
                               "raise --kv-cache-gib)")
    return times


def prefill_steps(core: EngineCore, a: argparse.Namespace, timers: Timers,
                  variants: dict[str, Variant]) -> dict[str, list[float]]:
    """Time `a.steps` prefill steps per variant, alternating, each of a.chunk // a.context fresh prompts that
    end at their first token; seconds per step."""
    rng = random.Random(0)
    per_step = max(1, a.chunk // a.context)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(2 + len(variants) * a.steps):  # the first two warm up
        name = list(variants)[i % len(variants)]
        core.runner.model.use_fused_ops(variants[name].ops)
        step = core.runner.model.decode_step = variants[name].step
        for j in range(per_step):
            prompt = [rng.randrange(100, 40000) for _ in range(a.context)]
            core.add_request(Request(f"s{i}-{j}", prompt, SamplingParams(max_tokens=1, temperature=0), [0]))
        before = None if step is None else step.phase_ns.clone()
        timed = i >= 2
        timers.variant = name if timed else None
        t0 = time.perf_counter()
        outs = core.step()
        if timed:
            times[name].append(time.perf_counter() - t0)
        timers.variant = None
        if timed and step is not None and before is not None:
            for phase, ns in zip(PHASES, (step.phase_ns - before).tolist(), strict=True):
                timers.seconds[name][PHASE_COMPONENTS[phase]] += ns / 1e9
        if sum(len(o.new_token_ids) for o in outs) != per_step or core.has_requests:
            raise RuntimeError("a timed step was not one whole prefill of its prompts (raise --kv-cache-gib)")
    return times


def copy_rate(core: EngineCore, nbytes: float) -> float:
    """GB/s read by a copy of the used region of the KV pool (as many bytes as a step's attention reads,
    or the whole used region if that is smaller)."""
    pool = core.runner.kv_pool  # [layers, 2, blocks, block_size, nkv, D]
    per_block = pool[0, 0, 0].numel() * pool.element_size() * pool.shape[0] * 2
    blocks = max(1, min(pool.shape[2], int(nbytes // per_block) + 1))
    src = pool[:, :, :blocks]
    dst = torch.empty_like(src)
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / statistics.median(ts[1:]) / 1e9


def read_rate(nbytes: int = 256 << 20) -> float:
    """GB/s at which this machine streams a float32 tensor of `nbytes` (far past the caches) into a sum."""
    x = torch.ones(nbytes // 4)
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts[1:]) / 1e9


def breakdown(timers: Timers, name: str, steps: list[float]) -> dict[str, Any]:
    """Milliseconds per step of each component, and the Python left over."""
    n = len(steps)
    sec = {k: v / n for k, v in timers.seconds[name].items()}
    step = statistics.mean(steps)
    comp = {k: sec.get(k, 0.0) for k in IN_FORWARD + OUTSIDE}
    comp["python_in_forward"] = sec.get("forward", 0.0) - sum(comp[k] for k in IN_FORWARD)
    comp["python_runner_scheduler"] = step - sec.get("forward", 0.0) - sum(comp[k] for k in OUTSIDE)
    att = sec.get("attention", 0.0)
    return {"step_ms_mean": step * 1e3, "step_ms_median": statistics.median(steps) * 1e3,
            "components_ms": {k: v * 1e3 for k, v in comp.items()},
            "attention_kv_read_gb_s": timers.kv_bytes[name] / n / att / 1e9 if att else None,
            "kv_bytes_per_step": timers.kv_bytes[name] / n}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per variant")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--prefill", action="store_true", help="profile prefill steps, not decode steps")
    ap.add_argument("--chunk", type=int, default=512, help="with --prefill: tokens per step")
    ap.add_argument("--name", default="profile_step",
                    help="write bench/results/<name>.{json,md,png} (another machine's profile beside this one)")
    return ap.parse_args()


def measure(a: argparse.Namespace) -> dict[str, Any]:
    if a.threads:
        torch.set_num_threads(a.threads)
    core = EngineCore(EngineConfig(model=a.model, dtype="float32", kv_cache_gib=a.kv_cache_gib,
                                   max_model_len=a.context + 64, max_num_seqs=max(64, a.batch),
                                   max_num_batched_tokens=4096), runner=ModelRunner)
    model = core.runner.model
    fused, step = model.ops, model.decode_step
    variants = {"torch": Variant(TORCH_OPS, None), "fused": Variant(fused, None)}
    if isinstance(step, DecodeStep):
        step.phase_ns = torch.zeros(len(PHASES), dtype=torch.int64)
        variants["one_call"] = Variant(fused, step)
    timers = Timers()
    instrument(core, timers, {name: v.ops for name, v in variants.items()})
    times = (prefill_steps if a.prefill else decode_steps)(core, a, timers, variants)
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                           "fused_kernels_built": fused.native,
                           "one_call": None if step is None else step.kind,
                           "variants": {name: breakdown(timers, name, ts) for name, ts in times.items()}}
    kv_bytes = res["variants"]["fused"]["kv_bytes_per_step"]
    res["kv_copy_gb_s"] = copy_rate(core, kv_bytes)
    # The bytes of the weights a step reads: its panels (float32, or the GGUF file's blocks: panel_matmul.py)
    # where the model has them.
    panels_bytes = sum(p.panels.nbytes for layer in model.layers for p in cast(DecoderLayer, layer).panels.values())
    if panels_bytes and model.panel_head is not None:
        panels_bytes += model.panel_head.panels.nbytes
    # ... or, for steps the float32 AMX kernel takes, its copies (2.25 bytes a weight). A decode step's rows
    # are its sequences, a prefill step's its prompts' tokens.
    prompts = a.chunk // a.context
    rows = prompts * a.context if a.prefill else a.batch
    model_amx = model.uses_amx_float32
    if model_amx and rows >= AMX_F32_FROM_ROWS:
        panels_bytes = sum(p.panels.nbytes for layer in model.layers
                           for p in cast(DecoderLayer, layer).amx_f32.values())
        head_copy = model.amx_f32_head if model.amx_f32_head is not None else model.panel_head
        panels_bytes += head_copy.panels.nbytes if head_copy is not None else 0
    core.shutdown()
    cfg, _, _ = load_config_and_tokenizer(resolve_model(a.model))
    # A decode step: every row through the layers and the head; a prefill step: its tokens through the layers,
    # its prompts' last tokens through the head.
    prompt_f, token_f = flops_per_token(cfg)
    gflop = (rows * prompt_f + prompts * (token_f - prompt_f) if a.prefill else rows * token_f) / 1e9
    roof = Path(tempfile.gettempdir()) / "tandem-roofline"
    panels = load_panel_kernel(roof)
    amx = load_amx_kernel(roof) if amx_unfit() is None and model_amx else None
    with_head = not a.prefill
    best = max(rate(cfg, rows, torch.float32, head=with_head), rate(cfg, rows, torch.float32, with_head, True),
               rate(cfg, rows, torch.float32, with_head, panels=panels) if panels else 0.0,
               rate(cfg, rows, torch.float32, with_head, amx=amx) if amx else 0.0)
    # Every projection weight and the LM head are read once per step (the roofline's rates re-read one
    # layer from cache), and the attention reads every sequence's K and V.
    layer, head, n_layers = shapes(cfg)
    weight_bytes = panels_bytes or 4 * (n_layers * sum(o * k for o, k in layer) + head[0] * head[1])
    stream = read_rate()
    res["ceiling"] = {"gflop_per_step": gflop, "matmul_gflop_s_at_batch": best,
                      "step_floor_ms": gflop / best * 1e3, "weight_bytes_per_step": weight_bytes,
                      "read_gb_s": stream, "memory_floor_ms": (weight_bytes + kv_bytes) / stream / 1e6}
    for v in res["variants"].values():
        v["share_of_ceiling"] = res["ceiling"]["step_floor_ms"] / v["step_ms_mean"]
        v["share_of_memory_floor"] = res["ceiling"]["memory_floor_ms"] / v["step_ms_mean"]
        v["tok_s"] = rows / v["step_ms_mean"] * 1e3
    return res


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    return measure(a)


def table(res: dict[str, Any]) -> str:
    v, c = res["variants"], res["ceiling"]
    names = list(v)
    head = " | ".join(f"{n} ms | {n} %" for n in names)
    cfg = res["config"]
    title = (f"# One prefill step of {cfg['chunk'] // cfg['context']} prompts of {cfg['context']} tokens"
             if cfg.get("prefill")
             else f"# One decode step at batch {cfg['batch']}, {cfg['context']} tokens of context")
    lines = [title,
             "", f"{describe(res['machine'])}; 1-minute load {res['load_average'][0]:.2f} -> "
             f"{res['load_average'][1]:.2f}, {res['threads']} threads, OMP_WAIT_POLICY={res.get('omp_wait_policy')}; "
             f"ceiling: {c['gflop_per_step']:.2f} GFLOP per "
             "step at "
             f"{c['matmul_gflop_s_at_batch']:.0f} GFLOP/s = {c['step_floor_ms']:.1f} ms; memory floor: "
             f"{(c['weight_bytes_per_step'] + v[names[0]]['kv_bytes_per_step']) / 1e6:.0f} MB of weights and KV "
             f"per step at {c['read_gb_s']:.1f} GB/s (a streamed sum) = {c['memory_floor_ms']:.1f} ms", "",
             f"| component | {head} |", "|---|" + "---:|" * (2 * len(names))]
    for comp in v[names[0]]["components_ms"]:
        cells = " | ".join(f"{v[n]['components_ms'][comp]:.2f} | "
                           f"{100 * v[n]['components_ms'][comp] / v[n]['step_ms_mean']:.1f}" for n in names)
        lines.append(f"| {comp} | {cells} |")
    lines.append("| **step (mean)** | " + " | ".join(f"**{v[n]['step_ms_mean']:.2f}** | 100" for n in names) + " |")
    lines += ["", "| variant | tok/s | share of ceiling | share of memory floor | attention KV read GB/s | "
              "copy of the same bytes GB/s |", "|---|---:|---:|---:|---:|---:|"]
    for n in names:
        gbs = v[n]["attention_kv_read_gb_s"]
        lines.append(f"| {n} | {v[n]['tok_s']:.1f} | {100 * v[n]['share_of_ceiling']:.1f}% | "
                     f"{100 * v[n]['share_of_memory_floor']:.1f}% | {gbs or 0:.1f} | {res['kv_copy_gb_s']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state

    v = res["variants"]
    names = list(v)
    comps = list(v[names[0]]["components_ms"])
    fig = Figure(figsize=(9, 3))
    ax = fig.subplots()
    left = [0.0] * len(names)
    for comp in comps:
        vals = [max(0.0, v[n]["components_ms"][comp]) for n in names]
        ax.barh(names, vals, left=left, label=comp)
        left = [lo + x for lo, x in zip(left, vals, strict=True)]
    ax.axvline(res["ceiling"]["step_floor_ms"], color="k", ls="--", label="fp32 ceiling")
    ax.axvline(res["ceiling"]["memory_floor_ms"], color="k", ls=":", label="memory floor")
    cfg = res["config"]
    what = (f"{cfg['chunk'] // cfg['context'] * cfg['context']}-token prefill step" if cfg.get("prefill")
            else f"Batch {cfg['batch']} decode step")
    ax.set_xlabel(f"ms per {'prefill' if cfg.get('prefill') else 'decode'} step")
    ax.set_title(f"{what} (load {res['load_average'][0]:.2f})", fontsize=10)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    return bench_main(args.name, args, run, table, plot)


if __name__ == "__main__":
    sys.exit(main())
