"""A deterministic in-test engine behind the real HTTP app, a uvicorn thread that serves it, and checks
of OpenAI-shaped answers.

`ToyEngine` tokenizes text as one token per character (id = code point, BOS = 1) and generates the
letters a, b, c, ... starting at `seed % 26`, one token per delta, with logprobs -0.5 per step; given
`pieces`, it generates those byte strings instead, as a byte-level tokenizer splits a character. Its GET
/tokenizer serves the same tokenizer (for ASCII text) as `tokenizers` and jinja2 write it. Given a
`waiting_bound`, it refuses requests past it as the real frontend does, counting its open streams.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import prometheus_client
import uvicorn
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

from tandem_engine.config import SchedulingPolicy
from tandem_engine.core.block_pool import HASH_SPEC
from tandem_engine.entrypoints.api_server import build_app
from tandem_engine.frontend.admission import WaitingBound
from tandem_engine.frontend.interface import (
    EngineClient,
    EngineDeadError,
    RequestError,
    RequestOutput,
    TokenCandidate,
    TokenLogprob,
)
from tandem_engine.frontend.tokenizer_spec import TokenizerSpec
from tandem_engine.sampling_params import SamplingParams

BOS = 1
MODEL = "toy-model"
LONG = "x" * 70  # 71 tokens with BOS, over max_model_len=64
CHAT = [{"role": "user", "content": "hi"}]
BLOCK_SIZE = 4
# `ToyEngine.apply_chat_template` as a chat template.
CHAT_TEMPLATE = ("\x01{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def toy_tokenizer_spec() -> bytes:
    """The toy tokenizer for ASCII text as GET /tokenizer serves it: a token per character, BOS first."""
    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token=chr(0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single=[chr(BOS), "$A"], special_tokens=[(chr(BOS), BOS)])
    spec = TokenizerSpec(model=MODEL, hash_spec=HASH_SPEC, block_size=BLOCK_SIZE, tokenizer_json=tok.to_str(),
                         chat_template=CHAT_TEMPLATE, special_tokens={"bos_token": chr(BOS)})
    return msgspec.json.encode(spec)


class ToyEngine(EngineClient):
    model_name = MODEL
    max_model_len = 64

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[str, list[int], SamplingParams, dict[str, Any] | None]] = []
        self.aborted: list[str] = []
        self.cancelled: list[str] = []  # iterators closed or cancelled before their final output
        self.ready = True
        self.dead: BaseException | None = None
        self.hang_after: int | None = None  # block forever after this many deltas
        self.fail_stream_after: int | None = None  # raise EngineDeadError after this many deltas
        self.delay = 0.0
        self.pieces: list[bytes] | None = None  # the tokens' bytes to generate instead of letters
        self.slow_tokenizer = False  # GET /tokenizer has nothing to serve
        self.scheduling_policy: SchedulingPolicy = "fcfs"
        self.waiting_bound: WaitingBound | None = None
        self.in_flight = 0
        self.priorities: dict[str, int] = {}

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "BUG" in text:
            raise RuntimeError("tokenizer exploded")
        return ([BOS] if add_special_tokens else []) + [ord(c) for c in text]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != BOS)  # chr raises ValueError past 0x10FFFF

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> str:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise RequestError(f"unknown role {m['role']!r}", param="messages")
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return "\x01" + text + ("<assistant>" if add_generation_prompt else "")

    def tokenizer_spec(self) -> bytes:
        if self.slow_tokenizer:
            raise TypeError("ToyTokenizer is not a fast tokenizer")
        return toy_tokenizer_spec()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       kv_transfer_params: dict[str, Any] | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, prompt_token_ids, params, kv_transfer_params))
        self.priorities[request_id] = priority
        if self.waiting_bound is not None:
            self.waiting_bound.check(self.in_flight + 1)
        self.in_flight += 1
        finished = False
        try:
            if self.dead is not None:
                raise EngineDeadError("engine core died")
            if ord("!") in prompt_token_ids:
                raise RequestError("prompt contains a forbidden token", param="prompt")
            text_of = codecs.getincrementaldecoder("utf-8")()
            for k in range(params.max_tokens):
                await self._pace(k)
                tid, data = self._token(k, params)
                text = text_of.decode(data)
                reason: str | None = None
                stop_reason: str | int | None = None
                if text in params.stop:
                    reason, stop_reason = "stop", text
                    if not params.include_stop_str_in_output:
                        text = ""
                elif tid in params.stop_token_ids:
                    reason, stop_reason = "stop", tid
                elif k + 1 == params.max_tokens:
                    reason = "length"
                finished = reason is not None
                yield RequestOutput(
                    request_id=request_id,
                    text=text,
                    token_ids=[tid],
                    logprobs=None if params.logprobs is None else [self._logprob(k, params)],
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=k + 1,
                    num_cached_tokens=0,
                    finished=finished,
                    finish_reason=reason,  # type: ignore[arg-type]
                    stop_reason=stop_reason,
                    kv_transfer_params={"remote_request_id": request_id}
                    if finished and kv_transfer_params
                    else None,
                )
                if finished:
                    return
        finally:
            self.in_flight -= 1
            if not finished:
                self.cancelled.append(request_id)

    async def _pace(self, k: int) -> None:
        if self.hang_after is not None and k >= self.hang_after:
            await asyncio.Event().wait()
        if self.fail_stream_after is not None and k >= self.fail_stream_after:
            raise EngineDeadError("engine core died mid-stream")
        await asyncio.sleep(self.delay)

    def _token(self, k: int, params: SamplingParams) -> tuple[int, bytes]:
        """Token k of the output: (id, its bytes)."""
        if self.pieces is not None:
            return 1000 + k, self.pieces[k % len(self.pieces)]
        tid = ord("a") + ((params.seed or 0) + k) % 26
        return tid, chr(tid).encode()

    def _logprob(self, k: int, params: SamplingParams) -> TokenLogprob:
        """The sampled token at -0.5, then its successors as alternatives at -1.5, -2.5, ..."""
        num_top = params.logprobs or 0
        top = [self._candidate(k + j, params, -0.5 - j) for j in range(num_top)]
        sampled = self._candidate(k, params, -0.5)
        return TokenLogprob(sampled.token_id, sampled.token, sampled.token_bytes, sampled.logprob, top)

    def _candidate(self, k: int, params: SamplingParams, logprob: float) -> TokenCandidate:
        tid, data = self._token(k, params)
        return TokenCandidate(tid, data.decode("utf-8", errors="replace"), data, logprob)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    @property
    def is_ready(self) -> bool:
        return self.ready and self.dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self.dead


class ServerThread:
    """The app of `engine` under uvicorn on a free port, in a daemon thread."""

    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine
        app = build_app(engine, prometheus_client.CollectorRegistry())
        # Port 0: the kernel picks a free port as uvicorn binds, so no other process can take it first.
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing of every event on the way."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        assert "\n" not in event
        payloads.append(event[len("data: ") :])
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def assert_error(resp: httpx.Response, status: int, param: str | None = None, contains: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err["message"]
