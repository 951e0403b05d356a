"""Prometheus metrics of one engine, under vLLM's names so existing dashboards and autoscalers work."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from tandem_engine.cpu_budget import ThreadPlan
from tandem_engine.protocol import SchedulerStats

# `_created` series double the scrape size and no vLLM dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated in prometheus_client

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", lbl, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", lbl,
                              registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lbl, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lbl,
                                   registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lbl, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests", lbl + ["finished_reason"],
                                       registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", lbl,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduling",
                                    lbl, buckets=_LATENCY_BUCKETS, registry=r)
        # KV transfer (P/D)
        self.kv_sent = Counter("tandem:kv_transfer_sent_blocks", "KV blocks read from this prefill engine",
                               lbl, registry=r)
        self.kv_received = Counter("tandem:kv_transfer_received_blocks", "KV blocks pulled by this decode engine",
                                   lbl, registry=r)
        self.kv_failures = Counter("tandem:kv_transfer_failures", "Failed KV transfers", lbl, registry=r)
        self.kv_expired = Counter("tandem:kv_leases_expired", "Leases on this prefill engine's blocks that ran "
                                  "out before a decode engine released them", lbl, registry=r)
        self.kv_seconds = Histogram("tandem:kv_transfer_seconds", "Duration of one request's KV transfer", lbl,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_held = Gauge("tandem:kv_blocks_held_for_transfer", "Blocks held for decode engines to read",
                             lbl, registry=r)
        self.threads = Gauge("tandem:engine_threads", "Intra-op threads per EngineCore, and the CPU limit "
                             "that decided it (source: affinity, cgroup quota, downward API or --num-threads)",
                             [*lbl, "source", "cpus"], registry=r)
        # What a router reads to size its per-engine in-flight cap without knowing the engine's flags.
        self.max_num_seqs = Gauge("tandem:engine_max_num_seqs", "Requests this engine runs at once: "
                                  "--max-num-seqs summed over its data-parallel EngineCores", lbl, registry=r)
        # vLLM's cache description: one series at 1 whose labels are the cache's settings.
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the KV cache (labels)",
                                  [*lbl, "block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching"],
                                  registry=r)
        self.model_info = Gauge("tandem:model_info", "Always 1: how the model runs (compute dtype and "
                                "--quantization of the projections)", [*lbl, "dtype", "quantization"], registry=r)
        self._per_engine: dict[int, SchedulerStats] = {}
        # Publish every unlabelled-by-reason series at 0 from the start, so a fresh /metrics is complete.
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.kv_sent, self.kv_received, self.kv_failures, self.kv_seconds,
                       self.kv_held, self.kv_expired):
            metric.labels(model_name)

    def record_thread_plan(self, plan: ThreadPlan) -> None:
        source = plan.limit.source if plan.limit else "--num-threads"
        cpus = f"{plan.limit.cpus:g}" if plan.limit else ""
        self.threads.labels(self.model_name, source, cpus).set(plan.threads)

    def record_cache_config(self, block_size: int, cache_dtype: str, num_blocks: int, prefix_caching: bool) -> None:
        """num_blocks: per EngineCore (vLLM's `num_gpu_blocks`, whatever the device)."""
        self.cache_config.labels(self.model_name, str(block_size), cache_dtype, str(num_blocks),
                                 str(prefix_caching)).set(1)

    def record_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        m = self.model_name
        self._per_engine[engine_index] = stats
        all_stats = list(self._per_engine.values())
        self.running.labels(m).set(sum(s.num_running for s in all_stats))
        self.waiting.labels(m).set(sum(s.num_waiting for s in all_stats))
        self.kv_usage.labels(m).set(sum(s.kv_cache_usage for s in all_stats) / len(all_stats))
        self.kv_held.labels(m).set(sum(s.kv_blocks_held_for_transfer for s in all_stats))
        self.prefix_queries.labels(m).inc(stats.prefix_cache_queries)
        self.prefix_hits.labels(m).inc(stats.prefix_cache_hits)
        self.kv_sent.labels(m).inc(stats.kv_transfer_sent_blocks)
        self.kv_received.labels(m).inc(stats.kv_transfer_received_blocks)
        self.kv_failures.labels(m).inc(stats.kv_transfer_failures)
        self.kv_expired.labels(m).inc(stats.kv_leases_expired)
        for s in stats.kv_transfer_seconds:
            self.kv_seconds.labels(m).observe(s)
