"""Continuous batching with one token budget for prefill and decode (vLLM v1's unified scheduler).

A step is a map {request: number of tokens to compute}. Running requests go first; when blocks run
out the last running request is preempted (recompute) and nothing new is admitted in that step.
Waiting requests are admitted in the queue's order with prefix-cache hits and chunked to the remaining
budget. Under `--scheduling-policy priority` the running list is kept in (priority, arrival) order, so
the last one, the one preempted, is the least urgent (vLLM's victim); under fcfs it is the newest.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable
from typing import Any

from tandem_engine.config import KVFailurePolicy, SchedulingPolicy
from tandem_engine.core.kv_cache_manager import KVCacheManager
from tandem_engine.core.request_queue import make_queue, priority_key
from tandem_engine.kv_transfer.interface import KVConnectorOutput, KVConnectorScheduler
from tandem_engine.protocol import EngineCoreOutput, Logprobs, SchedulerStats
from tandem_engine.request import Request, RequestStatus
from tandem_engine.scheduler_output import SampledToken, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
        kv_failure_policy: KVFailurePolicy = "fail",
        policy: SchedulingPolicy = "fcfs",
    ) -> None:
        self.kv = kv_cache_manager
        self.connector = connector
        self.kv_failure_policy = kv_failure_policy
        # Decode: requests whose blocks are allocated and being read from a prefill engine.
        self.waiting_for_kv: dict[str, Request] = {}
        # Ended while a read may still write their blocks: freed when the load reports.
        self._deferred_free: dict[str, Request] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.policy = policy
        self.waiting = make_queue(policy)
        self.running: list[Request] = []
        # Requests finished outside update_from_output (aborts) whose final output is still owed.
        self._finished_outputs: list[EngineCoreOutput] = []

    # -- intake -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.add(req)
        if self.connector is not None:
            self.connector.on_new_request(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        error: str | None = None) -> None:
        """Finish requests in any state (waiting, running, preempted, waiting for remote KV); unknown
        ids are ignored."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            may_free = True
            if req in self.running:
                self.running.remove(req)
            elif self.waiting_for_kv.pop(rid, None) is not None:
                assert self.connector is not None
                may_free = self.connector.request_ended_early(req)
            else:
                self.waiting.remove(req)
                if self.connector is not None:
                    self.connector.request_ended_early(req)
            req.status = status
            if may_free:
                self.kv.free(req)
            else:
                self._deferred_free[rid] = req
            self._finished_outputs.append(
                EngineCoreOutput(rid, [], finish_reason=status.finish_reason,
                                 num_cached_tokens=max(req.num_cached_tokens, 0), error=error)
            )

    def reject(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """End a request the scheduler never took (its grammar did not compile, or it was aborted while it
        compiled): only its final output is owed."""
        req.status = status
        self._finished_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason=status.finish_reason,
                                                       error=error))

    @property
    def has_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget,
                    self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            self._add_scheduled(out, req, n)
            budget -= n
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs):
            req = self.waiting.peek()
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if self.connector is not None and self.connector.remote_blocks_to_load(req, num_hit_tokens):
                if not self._admit_remote(req, hits, num_hit_tokens):
                    break
                continue
            n = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.pop()
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self._add_running(req)
            self._add_scheduled(out, req, n)
            budget -= n

        assert budget >= 0 and len(self.running) <= self.max_num_seqs
        return out

    def _admit_remote(self, req: Request, hits: list[int], num_hit_tokens: int) -> bool:
        """Allocate blocks for every prompt token but the last and hand the missing ones to the
        connector to read; the request computes nothing until its load reports."""
        assert self.connector is not None
        # Blocks become prefix-cache hits only once their KV has arrived: another request must not
        # hit them mid-read. The next allocate_slots (for the last token) caches them.
        new = self.kv.allocate_slots(req, req.num_prompt_tokens - 1 - num_hit_tokens, hits, cache_blocks=False)
        if new is None:
            return False
        self.waiting.pop()
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kv[req.request_id] = req
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), len(hits))
        return True

    def update_from_kv_output(self, out: KVConnectorOutput, now: float) -> None:
        """Apply the connector's finished loads, failed loads, releases and expired leases."""
        assert self.connector is not None
        for held in self.connector.update_from_output(out, now):
            self.kv.free(held)
        for rid in out.finished_recving:
            if (req := self._deferred_free.pop(rid, None)) is not None:
                self.kv.free(req)
            elif (req := self.waiting_for_kv.pop(rid, None)) is not None:
                # The prompt's KV is here but for the last token, recomputed for its logits.
                req.num_computed_tokens = req.num_prompt_tokens - 1
                req.status = RequestStatus.RUNNING
                self._add_running(req)
        for rid, reason in out.failed_recving.items():
            if (req := self._deferred_free.pop(rid, None)) is not None:
                self.kv.free(req)
            elif (req := self.waiting_for_kv.pop(rid, None)) is not None:
                if self.kv_failure_policy == "recompute":
                    logger.warning("request %s: %s; recomputing the prompt locally", rid, reason)
                    self.kv.free(req)
                    req.num_computed_tokens = 0
                    req.status = RequestStatus.WAITING
                    self.waiting.readd(req)
                else:
                    self.waiting_for_kv[rid] = req  # finish_requests frees it: the load has ended
                    self.finish_requests([rid], RequestStatus.FINISHED_ERROR, f"KV transfer failed: {reason}")

    def _add_running(self, req: Request) -> None:
        if self.policy == "priority":
            bisect.insort(self.running, req, key=priority_key)
        else:
            self.running.append(req)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        out.scheduled.append(
            ScheduledRequest(req, start, n, self.kv.get_block_ids(req.request_id),
                             sample=start + n >= req.num_tokens)
        )
        out.num_scheduled_tokens += n
        # Advanced now so the next chunk can be planned; the KV is written by this step's forward.
        req.num_computed_tokens = start + n

    def _preempt(self, req: Request) -> None:
        logger.debug("preempting %s", req.request_id)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.readd(req)

    # -- results ------------------------------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, sampled: dict[str, SampledToken]
    ) -> list[EngineCoreOutput]:
        outputs = self._finished_outputs
        self._finished_outputs = []
        for item in sched.scheduled:
            req = item.request
            if not item.sample or req.status is not RequestStatus.RUNNING:
                continue  # a partial prefill chunk, or finished (aborted) during the step
            tok = sampled[req.request_id]
            req.append_output_token(tok.token_id)
            status = self._check_stop(req, tok.token_id)
            error = None
            if req.grammar is not None and status is not RequestStatus.FINISHED_LENGTH:
                if not req.grammar.accept(tok.token_id):  # the mask allowed it: only a library fault lands here
                    status, error = RequestStatus.FINISHED_ERROR, f"structured output: {req.grammar.error}"
                elif req.grammar.stopped and status is None:
                    status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (ignore_eos, say)
            logprobs = None
            if tok.logprob is not None:
                logprobs = Logprobs([tok.logprob], [tok.top_ids or []], [tok.top_logprobs or []])
            output = EngineCoreOutput(req.request_id, [tok.token_id], logprobs,
                                      num_cached_tokens=req.num_cached_tokens)
            if req.num_output_tokens == 1 and req.first_scheduled_time is not None:
                output.queue_time = req.first_scheduled_time - req.arrival_time
            if status is not None:
                req.status = status
                output.finish_reason = status.finish_reason
                output.stop_reason = req.stop_reason
                output.kv_transfer_params = self._free_finished(req)
                output.error = error
            outputs.append(output)
        return outputs

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in sp.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _free_finished(self, req: Request) -> dict[str, Any] | None:
        """Free a finished request's blocks, unless the connector holds them for a remote decode
        (then returns the `kv_transfer_params` that name them)."""
        self.running.remove(req)
        del self.requests[req.request_id]
        if self.connector is not None:
            params = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
            if params is not None:
                return params
        self.kv.free(req)
        return None

    def stats(self) -> SchedulerStats:
        queries, hits = self.kv.take_prefix_stats()
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.waiting_for_kv),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )
        if self.connector is not None:
            kv = self.connector.take_stats()
            stats.kv_blocks_held_for_transfer = kv.held_blocks
            stats.kv_transfer_sent_blocks = kv.sent_blocks
            stats.kv_transfer_received_blocks = kv.received_blocks
            stats.kv_transfer_failures = kv.failures
            stats.kv_leases_expired = kv.expired_leases
            stats.kv_transfer_seconds = kv.seconds
        return stats
