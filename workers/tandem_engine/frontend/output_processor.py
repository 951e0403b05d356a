"""Turns EngineCore outputs into per-request RequestOutput deltas: incremental detokenization, stop
strings (with hold-back while streaming), logprob text, and per-request metrics.

A delta reports a token only with the text it completes (docs/contracts.md, "Token ids"): text held
back (a character still incomplete, the start of a possible stop string) keeps its tokens back too, so
the tokens a client has seen are always exactly those of the text it has seen, until the final delta.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tandem_engine.frontend.detokenizer import Detokenizer, TextStream
from tandem_engine.frontend.interface import RequestOutput, TokenCandidate, TokenLogprob
from tandem_engine.frontend.metrics import EngineMetrics
from tandem_engine.protocol import EngineCoreOutput, EngineCoreOutputs
from tandem_engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    queue: asyncio.Queue[RequestOutput | BaseException]
    decoder: TextStream
    arrival: float = field(default_factory=time.monotonic)
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    num_output_tokens: int = 0
    last_token_time: float | None = None
    # Generated tokens not yet reported, with the length of `text` once each one's character is whole
    # (None while it is not) and their logprobs when asked for.
    unreported: list[int] = field(default_factory=list)
    ends: list[int | None] = field(default_factory=list)
    unreported_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def holdback(self) -> int:
        # Also with include_stop_str_in_output: text sent is never part of an undecided stop string, so
        # a request resumed elsewhere after it still sees any stop string whole.
        if not self.params.stop:
            return 0
        return max(len(s) for s in self.params.stop) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Any, metrics: EngineMetrics) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}
        # Requests finished here by a stop string: the engine must be told to abort them.
        self.to_abort: list[str] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                    ) -> asyncio.Queue[RequestOutput | BaseException]:
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        decoder = self.detokenizer.text_stream(params.skip_special_tokens, prompt_token_ids)
        self.states[request_id] = RequestState(request_id, len(prompt_token_ids), params, q, decoder)
        return q

    def remove(self, request_id: str) -> bool:
        return self.states.pop(request_id, None) is not None

    def take_aborts(self) -> list[str]:
        """Requests finished here (by a stop string) since the last call, which the engine must abort."""
        ids, self.to_abort = self.to_abort, []
        return ids

    def fail_all(self, error: BaseException) -> None:
        for state in self.states.values():
            state.queue.put_nowait(error)
        self.states.clear()

    def process(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self.metrics.record_stats(outputs.engine_index, outputs.stats)
        now = time.monotonic()
        for out in outputs.outputs:
            state = self.states.get(out.request_id)
            if state is not None:
                self._process_one(state, out, now)

    def _process_one(self, state: RequestState, out: EngineCoreOutput, now: float) -> None:
        m, name = self.metrics, self.metrics.model_name
        finish_reason: Any = out.finish_reason
        stop_reason: str | int | None = out.stop_reason
        if out.new_token_ids:
            if state.num_output_tokens == 0:
                m.ttft.labels(name).observe(now - state.arrival)
                m.prompt_tokens.labels(name).inc(state.num_prompt_tokens)
                if out.queue_time is not None:
                    m.queue_time.labels(name).observe(max(out.queue_time, 0.0))
            elif state.last_token_time is not None:
                m.itl.labels(name).observe(now - state.last_token_time)
            state.last_token_time = now
            state.num_output_tokens += len(out.new_token_ids)
            m.generation_tokens.labels(name).inc(len(out.new_token_ids))
            old_len = len(state.text)
            self._decode(state, out)
            matched = self._find_stop(state, old_len)
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
                if out.finish_reason is None:
                    self.to_abort.append(state.request_id)

        finished = finish_reason is not None
        num_tokens, end = self._reportable(state, finished)
        delta, state.sent = state.text[state.sent:end], end
        token_ids, state.unreported = state.unreported[:num_tokens], state.unreported[num_tokens:]
        del state.ends[:num_tokens]
        logprobs, state.unreported_logprobs = (state.unreported_logprobs[:num_tokens],
                                               state.unreported_logprobs[num_tokens:])
        result = RequestOutput(
            request_id=state.request_id,
            text=delta,
            token_ids=token_ids,
            logprobs=logprobs if state.params.logprobs is not None else None,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            kv_transfer_params=out.kv_transfer_params,
        )
        if finished:
            del self.states[state.request_id]
            m.e2e.labels(name).observe(now - state.arrival)
            m.request_success.labels(name, finish_reason).inc()
        state.queue.put_nowait(result)

    def _decode(self, state: RequestState, out: EngineCoreOutput) -> None:
        """Append the new tokens' text, and each token with where its text ends once it is whole."""
        for tid in out.new_token_ids:
            piece = state.decoder.step(tid)
            state.unreported.append(tid)
            state.ends.append(None)
            if piece is not None:
                state.text += piece
                # This piece completes every token still waiting for its character.
                k = len(state.ends) - 1
                while k >= 0 and state.ends[k] is None:
                    state.ends[k] = len(state.text)
                    k -= 1
        if state.params.logprobs is not None:
            state.unreported_logprobs += self._logprobs(out) or []

    @staticmethod
    def _reportable(state: RequestState, finished: bool) -> tuple[int, int]:
        """(tokens, text end) of what may be reported now: everything once finished; else the tokens
        whose text is whole and clear of the stop-string hold-back, and exactly their text."""
        if finished:
            return len(state.unreported), len(state.text)
        limit = max(len(state.text) - state.holdback, state.sent)
        num_tokens, end = 0, state.sent
        for end_k in state.ends:
            if end_k is None or end_k > limit:
                break
            num_tokens, end = num_tokens + 1, end_k
        return num_tokens, end

    @staticmethod
    def _find_stop(state: RequestState, old_len: int) -> str | None:
        """Truncate the text at the first stop string that appears in the new text."""
        best: tuple[int, str] | None = None
        for stop in state.params.stop:
            idx = state.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        state.text = state.text[: idx + len(stop)] if state.params.include_stop_str_in_output \
            else state.text[:idx]
        state.sent = min(state.sent, len(state.text))
        return stop

    def _logprobs(self, out: EngineCoreOutput) -> list[TokenLogprob] | None:
        lp = out.logprobs
        if lp is None:
            return None
        detok = self.detokenizer
        result = []
        for i, tid in enumerate(out.new_token_ids):
            top = [TokenCandidate(t, detok.token_text(t), detok.token_bytes(t), v)
                   for t, v in zip(lp.top_ids[i], lp.top_logprobs[i], strict=True)]
            result.append(TokenLogprob(tid, detok.token_text(tid), detok.token_bytes(tid), lp.sampled[i], top))
        return result
