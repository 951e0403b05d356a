"""Greedy decoding straight through a ModelRunner, free or teacher-forced, to compare numeric variants of
one model (a KV cache dtype against float32, docs/benchmarks.md) token by token and logprob by logprob.

No scheduler: the prompts run as one batch, a prefill then one decode row per prompt per step, on
blocks laid out in order from block 1 (block 0 stays the null block, as in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem_engine.worker.model_runner import ModelRunner


@dataclass
class GreedyRun:
    greedy: list[list[int]]  # [prompt][step] the argmax token of each step
    kept: list[list[int]]  # [prompt][step] the token fed to the next step: greedy, or the forced one
    logprobs: list[list[float]]  # [prompt][step] log-probability of the kept token


@torch.inference_mode()
def greedy_decode(runner: ModelRunner, prompts: list[list[int]], steps: int,
                  forced: list[list[int]] | None = None) -> GreedyRun:
    """Decode `steps` tokens after every prompt. With `forced`, step t of prompt i feeds `forced[i][t]`
    whatever the argmax was (teacher forcing: every variant sees the same context)."""
    bs = runner.block_size
    tables, next_block = [], 1
    for p in prompts:
        n = -(-(len(p) + steps) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    if next_block > runner.num_blocks:
        raise ValueError(f"{len(prompts)} prompts of {steps} steps need {next_block} KV blocks, the runner "
                         f"has {runner.num_blocks}")
    run = GreedyRun([[] for _ in prompts], [[] for _ in prompts], [[] for _ in prompts])
    logits = runner._forward(prompts, [0] * len(prompts), tables, [True] * len(prompts))
    for t in range(steps):
        logp = torch.log_softmax(logits.float(), dim=-1)  # [num_prompts, vocab]
        greedy = logp.argmax(dim=-1).tolist()
        kept = [f[t] for f in forced] if forced is not None else greedy
        for i, (g, k) in enumerate(zip(greedy, kept, strict=True)):
            run.greedy[i].append(g)
            run.kept[i].append(k)
            run.logprobs[i].append(float(logp[i, k]))
        if t + 1 < steps:
            logits = runner._forward([[k] for k in kept], [len(p) + t for p in prompts], tables,
                                     [True] * len(prompts))
    return run


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions, over all prompts, where two runs' tokens are equal."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def logprob_drift(run: GreedyRun, ref: GreedyRun) -> list[float]:
    """|logprob difference| of the kept tokens at every position (both runs fed the same tokens)."""
    assert run.kept == ref.kept, "drift compares runs fed the same tokens"
    return [abs(x - y) for ra, rb in zip(run.logprobs, ref.logprobs, strict=True) for x, y in zip(ra, rb, strict=True)]
