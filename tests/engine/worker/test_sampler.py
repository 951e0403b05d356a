"""Seeded sampling depends on (seed, absolute position, logits) only: a request resumed with its
generated tokens appended to the prompt draws the same noise, whatever this sampler did before."""

from __future__ import annotations

import torch

from tandem_engine.request import Request
from tandem_engine.sampling_params import SamplingParams
from tandem_engine.worker.sampler import Sampler, position_seed

VOCAB = 512


def seeded(prompt: list[int], outputs: list[int], seed: int | None = 7) -> Request:
    r = Request("r", prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=64))
    for t in outputs:
        r.append_output_token(t)
    return r


def logits_at(position: int) -> torch.Tensor:
    # A flat-ish distribution: many tokens stay in the top-p set, so the noise decides.
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(position)) * 0.5


def test_the_token_depends_on_the_absolute_position_not_on_the_steps_taken() -> None:
    prompt, outputs = [3, 4, 5, 6, 7], [11, 12, 13]
    original, resumed = seeded(prompt, outputs), seeded(prompt + outputs, [])
    sampler = Sampler()
    for step in range(12):
        logits = logits_at(step).unsqueeze(0)
        [tok_a] = sampler(logits, [original])
        # Another sampler, other requests in the batch, other rows sampled before: the same token.
        other = Sampler()
        other(torch.randn(3, VOCAB), [seeded([9], [], seed=1), seeded([9, 9], [], seed=None), seeded([1], [], 3)])
        _, tok_b = other(torch.cat([torch.randn(1, VOCAB), logits]), [seeded([8, 8], [], seed=None), resumed])
        assert tok_a.token_id == tok_b.token_id
        original.append_output_token(tok_a.token_id)
        resumed.append_output_token(tok_b.token_id)
    assert original.all_token_ids == resumed.all_token_ids


def test_seeds_and_positions_give_distinct_noise() -> None:
    # Sample i of a request with n > 1 is seeded seed + i: seed + 1 here must not be seed one step on.
    seeds = {position_seed(seed, pos) for seed in range(-8, 8) for pos in range(64)}
    assert len(seeds) == 16 * 64
    sampler = Sampler()
    flat = torch.zeros(1, VOCAB)
    tokens = {sampler(flat, [seeded([1] * pos, [])])[0].token_id for pos in range(1, 41)}
    assert len(tokens) > 30, "a uniform distribution sampled at 40 positions should rarely repeat"
    by_seed = {sampler(flat, [seeded([1] * 5, [], seed=s)])[0].token_id for s in range(40)}
    assert len(by_seed) > 30
