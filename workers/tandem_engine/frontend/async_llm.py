"""AsyncLLM: the async frontend of one engine (input processor, output processor, core client)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tandem_engine.config import EngineConfig
from tandem_engine.cpu_budget import ThreadPlan
from tandem_engine.frontend.admission import WaitingBound
from tandem_engine.frontend.chat_templates import tools_template
from tandem_engine.frontend.core_client import CoreClient
from tandem_engine.frontend.interface import EngineClient, EngineCores, EngineDeadError, RequestError, RequestOutput
from tandem_engine.frontend.metrics import EngineMetrics
from tandem_engine.frontend.output_processor import OutputProcessor
from tandem_engine.frontend.tokenizer_spec import tokenizer_spec
from tandem_engine.models.loader import eos_token_ids, load_config_and_tokenizer, resolve_model
from tandem_engine.protocol import EngineCoreOutputs, EngineCoreRequest
from tandem_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem_engine.models.loader import HFConfig

logger = logging.getLogger(__name__)


class AsyncLLM(EngineClient):
    """The frontend of one engine. `await AsyncLLM.create(CoreClient.start(config))` returns it started: every
    EngineCore READY and its outputs flowing."""

    @classmethod
    async def create(cls, core: CoreClient) -> AsyncLLM:
        """Given EngineCores just launched (`CoreClient.start`), load the tokenizer while they load the
        model, wait for READY. Raises EngineStartupError (the engines stopped) if one fails to start."""
        config, plan = core.config, core.thread_plan
        try:
            src = resolve_model(config.model, config.cache_path)
            hf_config, tokenizer, generation_config = await asyncio.to_thread(load_config_and_tokenizer, src)
            await core.wait_ready()
        except BaseException:
            core.terminate()
            raise
        engine = cls(config, plan, core, hf_config, tokenizer,
                     eos_token_ids(hf_config, tokenizer, generation_config))
        try:
            await asyncio.to_thread(engine.tokenizer_spec)  # built off the event loop, before the first GET
        except TypeError as e:  # a slow tokenizer: the engine serves, without GET /tokenizer
            logger.warning("[startup] GET /tokenizer is unavailable: %s", e)
        logger.info("[startup] %d engine(s) ready in %.1fs", len(core.procs), time.perf_counter() - core.launched_at)
        return engine

    def __init__(self, config: EngineConfig, thread_plan: ThreadPlan, core: EngineCores,
                 hf_config: HFConfig, tokenizer: Any, eos_ids: list[int], tokenizer_spec: bytes | None = None) -> None:
        """Takes a core client whose engines are READY (see `create`) and starts consuming its outputs.
        `tokenizer_spec`: GET /tokenizer's body when another engine of the same tokenizer built it already."""
        self.config = config
        self.thread_plan = thread_plan
        self.model_name = config.served_name
        self.metrics = EngineMetrics(self.model_name)
        self.metrics.record_thread_plan(thread_plan)
        self.metrics.max_num_seqs.labels(self.model_name).set(config.max_running_requests)
        first = core.ready[0]
        self.metrics.record_cache_config(first.block_size, first.kv_cache_dtype, first.num_kv_blocks,
                                         config.enable_prefix_caching)
        self.metrics.model_info.labels(self.model_name, core.model_dtype, config.quantization).set(1)
        self.scheduling_policy = config.scheduling_policy
        self.tool_call_parser = config.tool_call_parser
        self.waiting_bound = WaitingBound(config.max_running_requests, config.max_waiting_requests)
        self.core = core
        self.max_model_len = core.max_model_len
        self.tokenizer = tokenizer
        self.vocab_size: int | None = int(getattr(hf_config, "vocab_size", 0)) or None
        self.eos_token_ids = eos_ids
        self.output_processor = OutputProcessor(tokenizer, self.metrics)
        self._tokenizer_spec = tokenizer_spec
        self._dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._draining = False
        core.run(self._on_outputs, self._on_dead)

    def add_death_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback` when an EngineCore dies, after every pending request has failed."""
        self._death_callbacks.append(callback)

    async def shutdown(self, drain_s: float = 30.0) -> None:
        """Stop the EngineCores once their requests and KV leases are done, at most `drain_s` seconds."""
        self._draining = True
        await self.core.shutdown(drain_s)

    def begin_drain(self) -> None:
        self._draining = True

    # -- EngineClient -------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._dead is None and not self._draining

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                          chat_template=chat_template,
                                                          add_generation_prompt=add_generation_prompt))
        except Exception as e:  # jinja errors on malformed messages
            raise RequestError(f"could not apply the chat template: {e}", "messages") from e

    def model_chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template if isinstance(template, str) else None

    def special_token_id(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return ids[0] if len(ids) == 1 and ids[0] in added else None

    def tokenizer_spec(self) -> bytes:
        if self._tokenizer_spec is None:  # about 2 MB of JSON: built once, then served as is
            self._tokenizer_spec = tokenizer_spec(self.tokenizer, self.model_name, self.config.block_size,
                                                  tools_template(self.model_chat_template()))
        return self._tokenizer_spec

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._draining:
            raise EngineDeadError("the engine is shutting down")
        self._validate(prompt_token_ids, params)
        if request_id in self.output_processor.states:
            raise RequestError(f"request id {request_id!r} is already in use")
        # Checked and added with no await in between: concurrent requests cannot all slip past the bound.
        self.waiting_bound.check(len(self.output_processor.states) + 1)
        # Room left in the context caps max_tokens (finish_reason "length").
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens > room:
            params = msgspec.structs.replace(params, max_tokens=room)
        q = self.output_processor.add_request(request_id, prompt_token_ids, params)
        req = EngineCoreRequest(request_id, prompt_token_ids, params, self.eos_token_ids, time.time(),
                                kv_transfer_params, priority)
        finished = False
        try:
            await self.core.add_request(req)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished and self.output_processor.remove(request_id):
                # Client gone (task cancelled / generator closed) or failure: free it in the engine.
                await self._abort_quietly([request_id])

    async def abort(self, request_id: str) -> None:
        if self.output_processor.remove(request_id):
            await self._abort_quietly([request_id])

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e)) from e
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(prompt_token_ids)} tokens", "prompt")
        vocab = self.vocab_size
        if vocab is not None and any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")

    async def _abort_quietly(self, request_ids: list[str]) -> None:
        try:
            await self.core.abort(request_ids)
        except EngineDeadError:
            pass

    # -- callbacks from the core client -------------------------------------------------------
    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.output_processor.process(outputs)
        ids = self.output_processor.take_aborts()
        if ids:
            asyncio.get_running_loop().create_task(self._abort_quietly(ids))

    def _on_dead(self, message: str) -> None:
        self._dead = EngineDeadError(message)
        self.output_processor.fail_all(self._dead)
        for callback in self._death_callbacks:
            callback(self._dead)

