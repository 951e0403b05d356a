"""The Router object: pools, policies, the upstream HTTP session, metrics, health checks and discovery."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from tandem_router.admission import Admission
from tandem_router.config import RouterConfig
from tandem_router.discovery import Discovery, make_discovery
from tandem_router.hashing import CHARS_PER_TOKEN
from tandem_router.health import HealthChecker
from tandem_router.kv_index import KVIndex, KVIndexFeed
from tandem_router.metrics import RouterMetrics
from tandem_router.policies import (
    BoundedPrefix,
    Decision,
    Policy,
    PrefixAware,
    PrefixView,
    RoutingRequest,
    ScoreWeights,
    make_policy,
)
from tandem_router.pool import Endpoint, Pool, PoolKind
from tandem_router.request import ParsedRequest, prompt_token_ids, routing_request
from tandem_router.tokenizer import PromptTokenizer, fetch_tokenizer

logger = logging.getLogger(__name__)
# Prompts up to this many characters (~2,000 tokens, ~3 ms) are tokenized for routing on the event loop.
INLINE_TOKENIZE_CHARS = 8192


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        checked = config.health_interval > 0
        self.decode = Pool(PoolKind.DECODE, config.index_capacity_blocks, checked)
        self.prefill = Pool(PoolKind.PREFILL, config.index_capacity_blocks, checked)
        weights = ScoreWeights(config.prefix_weight, config.queue_weight, config.kv_usage_weight,
                               config.min_prefix_fraction, config.cold_queue_slack)
        self.policies: dict[PoolKind, Policy] = {
            role: make_policy(name, config.load_factor, config.cold_key_blocks, weights)
            for role, name in ((PoolKind.DECODE, config.decode_policy), (PoolKind.PREFILL, config.prefill_policy))
        }
        # Whether anything reads prompt block hashes: a prefix-aware pool or the P/D decider.
        may_disaggregate = bool(config.prefill_urls or config.prefill_selector)
        prefix_policies = (PrefixAware, BoundedPrefix)
        self.uses_prefix_index = may_disaggregate or any(isinstance(p, prefix_policies) for p in self.policies.values())
        self.scrapes_engine_load = any(isinstance(p, PrefixAware) for p in self.policies.values())
        # The exact index, fed by every engine's KV events (docs/architecture.md, "Routing").
        self.kv_index = KVIndex()
        self.kv_feed = KVIndexFeed(self.kv_index, self._on_kv_resync, self._on_engine_load)
        self.follows_kv_events = self.uses_prefix_index and config.kv_events
        self.metrics.kv_index_blocks.set_function(self.kv_index.size)
        self.tokenizer: PromptTokenizer | None = None
        self._tokenizer_task: asyncio.Task[None] | None = None
        for pool in (self.decode, self.prefill):
            pool.listeners.append(self._on_health_change)
        self.admission = Admission(self)
        self.health = HealthChecker(self)
        self.revisions: set[str] = set()  # every engine revision seen, for the log
        self._revision_keys: set[tuple[str, str]] = set()  # (role, revision) ever exported
        self.discovery: Discovery = make_discovery(config)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() was not awaited"
        return self._session

    @property
    def pd_mode(self) -> bool:
        """The P/D flow (decode prefills locally while no prefill endpoint is healthy): when the router was
        given prefill URLs (the operator passes the prefill Service for a P/D service), or there is a prefill
        pool (with Kubernetes discovery, whatever prefill EndpointSlices exist right now). So a P/D service
        whose prefill pool is empty still counts what it prefilled on decode (`local_no_prefill`)."""
        return bool(self.config.prefill_urls) or bool(self.prefill.endpoints)

    def pool(self, role: PoolKind) -> Pool:
        return self.prefill if role is PoolKind.PREFILL else self.decode

    async def start(self) -> None:
        c = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=30),
            timeout=aiohttp.ClientTimeout(
                total=c.request_timeout, sock_connect=c.connect_timeout, sock_read=c.read_timeout
            ),
            auto_decompress=False,
        )
        await self.discovery.start(self)
        await self.health.start()  # "ready" means it knows which endpoints answer
        logger.info(
            "[startup] router ready: decode=%s prefill=%s policies decode=%s prefill=%s",
            sorted(self.decode.endpoints),
            sorted(self.prefill.endpoints),
            c.decode_policy,
            c.prefill_policy,
        )

    async def stop(self) -> None:
        await self.health.stop()
        await self.discovery.stop()
        await self.kv_feed.stop()
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        logger.info("[shutdown] router stopped")

    def prefix_view(self, pool: Pool, candidates: list[Endpoint], rreq: RoutingRequest) -> PrefixView:
        """The exact index's view when the request was tokenized and every candidate publishes KV
        events and is caught up; else the router's record of what it sent (approximate)."""
        hashes, tok = rreq.kv_hashes, self.tokenizer
        if hashes is not None and tok is not None and all(self.kv_feed.covers(e.url) for e in candidates):
            block_size = tok.block_size  # what `hashes` were cut by
            sizes = {e.url: self.kv_index.size(e.url) for e in candidates}
            # One index for both pools: keep the candidates' entries (a prefill engine holds prompts too).
            matches = {u: n for u, n in self.kv_index.match(hashes).items() if u in sizes}
            return PrefixView(matches, block_size, len(hashes), True, sizes)
        if not rreq.block_hashes:
            return PrefixView({}, 1.0, 0, False)
        sizes = {e.url: pool.index.size(e.url) for e in candidates}
        return PrefixView(pool.index.match(rreq.block_hashes), self.config.block_chars / CHARS_PER_TOKEN,
                          len(rreq.block_hashes), False, sizes)

    async def routing_request(self, parsed: ParsedRequest, session: str | None) -> RoutingRequest:
        """What the policies read of a request: its prompt's block hashes (of the text, and of the
        tokens when the router has the engines' tokenizer) and its load."""
        c = self.config
        rreq = routing_request(parsed, c.block_chars, c.max_blocks, session, self.uses_prefix_index)
        tok = self.tokenizer
        if tok is not None and self.follows_kv_events:
            # ~1 ms for a 600-token chat (template and tokenizer): on the event loop, since a hop to a thread
            # costs as much (two wake-ups, more on cores the engines keep busy) and both hold the GIL
            # anyway; long prompts go to a thread so that streams in flight keep flowing meanwhile.
            if len(parsed.prompt_text) <= INLINE_TOKENIZE_CHARS:
                ids = prompt_token_ids(tok, parsed)
            else:
                ids = await asyncio.to_thread(prompt_token_ids, tok, parsed)
            if ids is not None:
                rreq.kv_hashes = tok.block_hashes(ids)
                rreq.prompt_tokens = len(ids)
        return rreq

    async def _load_tokenizer(self, url: str) -> None:
        """The engines' tokenizer, from the first engine admitted that serves it (docs/contracts.md,
        "Block hashing"); until then, and without it, routing reads the approximate index."""
        try:
            self.tokenizer = await fetch_tokenizer(url, self.session)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            logger.warning("[kv-events] no tokenizer from %s (%s): routing uses the approximate index", url, e)
        else:
            logger.info("[kv-events] tokenizer of %s loaded from %s", self.tokenizer.model, url)
        finally:
            self._tokenizer_task = None

    def choose(self, pool: Pool, candidates: list[Endpoint], rreq: RoutingRequest, record: bool = True) -> Decision:
        """The policy's decision; `record=False` for a question (`POST /route/...`): no metrics."""
        policy = self.policies[pool.role]
        view = self.prefix_view(pool, candidates, rreq)
        d = policy.choose(candidates, rreq, view)
        d.view = view
        if not record:
            return d
        role = pool.role.value
        self.metrics.routing_decisions.labels(role, policy.name, d.endpoint.url, d.reason).inc()
        if view.num_blocks:
            self.metrics.prefix_lookups.labels(role, "exact" if view.exact else "approximate").inc()
            d.matched_blocks = view.matches.get(d.endpoint.url, 0)
            self.metrics.prefix_hit_ratio.labels(role).observe(view.cached_fraction(d.endpoint.url, rreq.prompt_tokens))
        return d

    def note_revision(self, ep: Endpoint, revision: str) -> None:
        """What an engine's /health said it is (an engine restarted under the same address may say otherwise)."""
        if revision != ep.revision:
            ep.revision = revision
            if revision not in self.revisions:
                self.revisions.add(revision)
                logger.info("[revision] %s endpoint %s serves revision %r (revisions seen: %s)", ep.role.value,
                            ep.url, revision, ", ".join(repr(r) for r in sorted(self.revisions)))
            self._export_revisions()

    def _export_revisions(self) -> None:
        """`tandem:router_revision_endpoints`: admitted endpoints per role and revision (0 once none is left)."""
        counts: dict[tuple[str, str], int] = {}
        for pool in (self.decode, self.prefill):
            for ep in pool.healthy():
                if ep.revision is not None:  # not yet checked: counted once its revision is known
                    counts[ep.role.value, ep.revision] = counts.get((ep.role.value, ep.revision), 0) + 1
        self._revision_keys |= set(counts)
        for key in self._revision_keys:
            self.metrics.revision_endpoints.labels(*key).set(counts.get(key, 0))

    def paired(self, decodes: list[Endpoint]) -> list[Endpoint]:
        """The decode candidates a request may go to: in P/D, those of a revision that has an admitted prefill
        endpoint (so its prompt can move between engines of one revision), unless there are none."""
        revisions = {e.revision for e in self.prefill.healthy() if e.revision is not None}
        return [e for e in decodes if e.revision is not None and e.revision in revisions] or decodes

    def revision_up(self, pool: Pool, revision: str | None, exclude: set[str]) -> str | None:
        """`revision` while `pool` has an admitted endpoint of it outside `exclude`, else None (any will do)."""
        if revision is None:
            return None
        return revision if any(e.url not in exclude for e in pool.healthy(revision)) else None

    def acquire(self, ep: Endpoint, tokens: int) -> None:
        ep.acquire(tokens)
        self._export_load(ep)

    def release(self, ep: Endpoint, tokens: int) -> None:
        ep.release(tokens)
        self._export_load(ep)

    def _export_load(self, ep: Endpoint) -> None:
        role = ep.role.value
        self.metrics.in_flight.labels(role, ep.url).set(ep.in_flight_requests)
        self.metrics.in_flight_tokens.labels(role, ep.url).set(ep.in_flight_tokens)

    def _on_health_change(self, ep: Endpoint, admitted: bool) -> None:
        self.metrics.healthy.labels(ep.role.value, ep.url).set(1 if admitted else 0)
        self._export_revisions()
        if not admitted or ep.revision is None:
            self.health.poke()  # new, ejected or of unknown revision: check it now rather than at the next interval
        if self.follows_kv_events and self._session is not None:
            if admitted:
                self.kv_feed.attach(self._session, ep.url)
                if self.tokenizer is None and self._tokenizer_task is None:
                    self._tokenizer_task = asyncio.get_running_loop().create_task(self._load_tokenizer(ep.url))
            elif ep.url not in self.pool(ep.role).endpoints:  # gone, not just ejected: its events stop
                asyncio.get_running_loop().create_task(self.kv_feed.detach(ep.url))

    def _on_engine_load(self, url: str, load: tuple[int, float] | None) -> None:
        """An engine's queue and KV usage from its KV events: fresher than a scrape, and the same for
        every router replica at the same moment, so replicas weigh loads alike. None: back to scrapes."""
        for pool in (self.decode, self.prefill):
            if (ep := pool.endpoints.get(url)) is not None:
                ep.load_from_events = load is not None
                if load is not None:
                    ep.engine_queue, ep.kv_usage = load

    def _on_kv_resync(self, url: str, reason: str) -> None:
        self.metrics.kv_index_resyncs.labels(url, reason).inc()
