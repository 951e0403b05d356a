"""Structured output in the EngineCore: each constrained request's grammar state (an llguidance matcher), the
compilation of grammars off the busy loop, and the token masks the sampler applies.

A request whose SamplingParams carry a grammar is held here until its matcher exists, then goes to the
scheduler; compiling never holds up the steps of other requests (it runs on a worker thread, and
llguidance releases the GIL while it builds a grammar). A grammar is compiled once: the matcher built for
it is kept (at most `CACHE_SIZE`, least recently used out) and every later request with the same grammar
starts from a copy. The matcher advances with every token the request samples, so its state follows the
request through preemption (the output stays, only the KV is recomputed) and is rebuilt from the tokens
where a request starts with output already made (docs/contracts.md, "Structured outputs").
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

CACHE_SIZE = 256


class Grammar:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return bool(self.matcher.consume_token(token_id))

    def accept_all(self, token_ids: list[int]) -> bool:
        return bool(self.matcher.consume_tokens(token_ids)) if token_ids else True

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (EOS taken, or a grammar that ends by itself)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self.matcher.get_error()) if self.matcher.is_error() else None

    def fill_mask(self, mask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `mask[row]` (int32 words, bit i%32 of word i//32 for token i)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, mask, row)


class GrammarCompiler:
    """Builds matchers on a worker thread, and keeps one per grammar to copy from."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        # Read and written by the one worker thread only.
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compiled = 0  # grammars compiled (cache misses), for tests and logs
        self.cache_hits = 0

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance

            t0 = time.perf_counter()
            spec = (self.tokenizer_dir / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(spec, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            logger.info("[structured] the grammar library's tokenizer built in %.2fs", time.perf_counter() - t0)
        return self._tokenizer

    def build(self, grammar: str) -> Grammar:
        """A fresh matcher at the start of `grammar` (from the cache, else compiled); raises ValueError when
        the grammar does not compile."""
        import llguidance

        template = self._cache.get(grammar)
        if template is not None:
            self._cache.move_to_end(grammar)
            self.cache_hits += 1
            return Grammar(template.deep_copy())
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        logger.debug("[structured] compiled a grammar in %.1f ms", (time.perf_counter() - t0) * 1e3)
        self.compiled += 1
        self._cache[grammar] = matcher
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return Grammar(matcher.deep_copy())

    def submit(self, grammar: str) -> Future[Grammar]:
        return self._pool.submit(self.build, grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
