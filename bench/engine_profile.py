"""Profile the EngineCore in-process (no HTTP, no ZMQ): where does a decode step's time go?

    .venv/bin/python bench/engine_profile.py --batch 32 --prompt-len 256 --output-len 128 [--profile]

Prints tok/s of the whole run, how long its prefill phase (the steps until every request has its first
token) and its decode phase took, and with --profile the split of decode steps between the model's
forward, the attention backend, sampling and the Python around them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from tandem_engine.config import EngineConfig
from tandem_engine.core.engine_core import EngineCore
from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.worker.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="the step's token budget (the server's default on a CPU is 512)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    core = EngineCore(EngineConfig(model=a.model, dtype=a.dtype, max_num_seqs=max(64, a.batch),
                                   max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=2048),
                      runner=ModelRunner)
    rng = random.Random(0)
    for i in range(a.batch):
        prompt = [rng.randrange(100, 40000) for _ in range(a.prompt_len)]
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=a.output_len, temperature=0,
                                                                  ignore_eos=True), [0]))
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    steps, decode_times, n_out = 0, [], 0
    started: set[str] = set()
    phase = {"prefill": 0.0, "decode": 0.0}
    while core.has_requests:
        ts = time.perf_counter()
        if prof and steps == 5:
            prof.enable()
        outs = core.step()
        if prof and steps == 15:
            prof.disable()
        steps += 1
        phase["prefill" if len(started) < a.batch else "decode"] += time.perf_counter() - ts
        started.update(o.request_id for o in outs)
        n_out += sum(len(o.new_token_ids) for o in outs)
        if steps > 2:
            decode_times.append(time.perf_counter() - ts)
    dt = time.perf_counter() - t0
    decode_times.sort()
    print(f"{n_out} tokens in {dt:.2f}s = {n_out / dt:.1f} tok/s; {steps} steps; decode step "
          f"p50 {decode_times[len(decode_times) // 2] * 1e3:.1f} ms, threads {torch.get_num_threads()}, "
          f"dtype {core.runner.dtype}; prefill phase {phase['prefill']:.2f}s, decode phase "
          f"{phase['decode']:.2f}s")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
