"""Turns EngineCore outputs into per-request RequestOutput deltas: incremental detokenization, stop
strings (with hold-back while streaming), logprob text, and per-request metrics."""

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

    @property
    def holdback(self) -> int:
        if not self.params.stop or self.params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.params.stop) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Any, metrics: EngineMetrics) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.metrics = metrics
        self.states: dict[str, RequestState] = {}
        # Requests finished here by a stop string: the engine must be told to abort them.
        self.to_abort: list[str] = []

    def add_request(self, request_id: str, num_prompt_tokens: int, params: SamplingParams
                    ) -> asyncio.Queue[RequestOutput | BaseException]:
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        decoder = self.detokenizer.text_stream(params.skip_special_tokens)
        self.states[request_id] = RequestState(request_id, num_prompt_tokens, params, q, decoder)
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
            for tid in out.new_token_ids:
                piece = state.decoder.step(tid)
                if piece:
                    state.text += piece
            matched = self._find_stop(state, old_len)
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
                if out.finish_reason is None:
                    self.to_abort.append(state.request_id)

        finished = finish_reason is not None
        end = len(state.text) if finished else max(len(state.text) - state.holdback, state.sent)
        delta, state.sent = state.text[state.sent:end], end
        result = RequestOutput(
            request_id=state.request_id,
            text=delta,
            token_ids=list(out.new_token_ids),
            logprobs=self._logprobs(out) if state.params.logprobs is not None else None,
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
