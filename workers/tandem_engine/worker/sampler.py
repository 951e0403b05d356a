"""Turns the logits at each request's last position into the next token (and its logprobs).

Order, as vLLM: a structured request's grammar mask first (forbidden tokens at -inf), then raw logprobs
(so a constrained request's logprobs are the model's distribution over the tokens its grammar allows, as
vLLM's default `raw_logprobs`), then min_tokens masking and penalties, temperature, min-p, top-k,
top-p, and sampling by argmax of probs / Exp(1) noise. A batch where every request is greedy without
penalties or logprobs is one argmax over the logits (the fused C kernel's on a CPU, kernels/fused.py: torch's
argmax took 2.2 ms of a 68 ms batch-32 decode step).

A seeded request's noise for a token depends only on (seed, the token's absolute position in the
sequence): never on how many steps this engine took. So a request resumed on another engine with the
tokens already generated appended to its prompt samples exactly what the original would have
(docs/contracts.md, "Resuming a request").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from tandem_engine.kernels.fused import TORCH_OPS
from tandem_engine.request import Request
from tandem_engine.scheduler_output import SampledToken


class TokenMask(Protocol):
    """A request's grammar as the sampler sees it (core/structured_output.py's Grammar)."""

    def fill_mask(self, mask: np.ndarray, row: int) -> None: ...


def apply_masks(logits: torch.Tensor, grammars: list[TokenMask | None]) -> None:
    """Set to -inf, in place, every logit of `logits` ([rows, vocab]) its row's grammar forbids."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    mask = np.full((len(rows), words), -1, dtype=np.int32)
    for k, i in enumerate(rows):
        g = grammars[i]
        assert g is not None
        g.fill_mask(mask, k)
    bits = (torch.from_numpy(mask).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _needs_penalties(req: Request) -> bool:
    sp = req.sampling_params
    return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1.0


def _needs_min_tokens_mask(req: Request) -> bool:
    sp = req.sampling_params
    return req.num_output_tokens < sp.min_tokens


_U64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the token at `position` (prompt length + output index) of a request seeded
    with `seed`: a hash, so that `seed + 1` at one position and `seed` at the next never share noise."""
    data = (seed & _U64).to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Sampler:
    def __init__(self, argmax: Callable[[torch.Tensor], list[int]] = TORCH_OPS.argmax) -> None:
        """argmax: each row's index of its largest value, as torch.argmax (FusedOps.argmax)."""
        # Re-seeded for every seeded row; unseeded rows draw from torch's default generator.
        self._seeded = torch.Generator()
        self._argmax = argmax

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        # logits: [num_reqs, vocab] float32
        if any(r.grammar is not None for r in reqs):
            apply_masks(logits, [r.grammar for r in reqs])
        if all(r.sampling_params.greedy and r.sampling_params.logprobs is None
               and not _needs_penalties(r) and not _needs_min_tokens_mask(r) for r in reqs):
            return [SampledToken(t) for t in self._argmax(logits)]
        return self._sample_general(logits, reqs)

    def _sample_general(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        logits = logits.float()
        want_logprobs = [r.sampling_params.logprobs is not None for r in reqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = logits.clone()
        for i, r in enumerate(reqs):
            if _needs_min_tokens_mask(r):
                banned = list(r.eos_token_ids | set(r.sampling_params.stop_token_ids))
                if banned:
                    kept = logits[i, banned].clone()
                    logits[i, banned] = float("-inf")
                    if r.grammar is not None and bool(torch.isinf(logits[i]).all()):
                        logits[i, banned] = kept  # the grammar allows nothing else: it must end here
            if _needs_penalties(r):
                self._apply_penalties(logits[i], r)

        greedy = torch.tensor([r.sampling_params.greedy for r in reqs])
        temps = torch.tensor([1.0 if r.sampling_params.greedy else r.sampling_params.temperature
                              for r in reqs], dtype=logits.dtype)
        scaled = logits / temps.unsqueeze(1)
        scaled = self._apply_top_k_top_p_min_p(scaled, reqs)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            seed = r.sampling_params.seed
            if seed is None:
                noise[i].exponential_()
            else:
                # The token being sampled sits at index num_tokens of prompt + output.
                self._seeded.manual_seed(position_seed(seed, r.num_tokens))
                noise[i].exponential_(generator=self._seeded)
        sampled = torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1))

        token_ids = sampled.tolist()
        out = []
        for i, r in enumerate(reqs):
            tok = SampledToken(token_ids[i])
            if raw_logprobs is not None and want_logprobs[i]:
                k = r.sampling_params.logprobs or 0
                tok.logprob = float(raw_logprobs[i, tok.token_id])
                if k > 0:
                    vals, ids = raw_logprobs[i].topk(k)
                    tok.top_ids, tok.top_logprobs = ids.tolist(), vals.tolist()
                else:
                    tok.top_ids, tok.top_logprobs = [], []
            out.append(tok)
        return out

    @staticmethod
    def _apply_penalties(row: torch.Tensor, r: Request) -> None:
        # row: [vocab], modified in place
        sp = r.sampling_params
        vocab = row.shape[0]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in r.all_token_ids if t < vocab}), dtype=torch.long)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=vocab)[:vocab].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _apply_top_k_top_p_min_p(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        # logits: [num_reqs, vocab], already temperature-scaled
        vocab = logits.shape[1]
        top_k = torch.tensor([r.sampling_params.top_k if r.sampling_params.top_k > 0 else vocab
                              for r in reqs])
        top_p = torch.tensor([r.sampling_params.top_p for r in reqs], dtype=logits.dtype)
        min_p = torch.tensor([r.sampling_params.min_p for r in reqs], dtype=logits.dtype)
        if bool((min_p > 0).any()):
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab).unsqueeze(0)
            drop = ranks >= top_k.unsqueeze(1)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits
