"""What the router reads from an OpenAI request body: the prompt text for hashing and load estimates;
and the `kv_transfer_params` it writes into the bodies of a P/D request's two legs.

The body is parsed once; the router forwards the client's bytes unchanged when it does not need to
rewrite them (colocated mode, or decode without remote prefill).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tandem_router.hashing import block_hashes, estimate_tokens
from tandem_router.policies import RoutingRequest
from tandem_router.tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

Kind = Literal["completions", "chat"]
DEFAULT_MAX_TOKENS = 256  # load estimate of an answer that may run to the end of the context
# OpenAI's default max_tokens of /v1/completions, as the engines apply it (docs/contracts.md).
COMPLETION_MAX_TOKENS = 16


def token_limit(kind: Kind, body: dict[str, Any]) -> int | None:
    """The answer's token budget as the engine reads the body: chat's max_completion_tokens or max_tokens,
    completions' max_tokens (16 when absent, as OpenAI defines it; null for none); None: up to the end of
    the context. A malformed value counts as none (the engine refuses it)."""
    if kind == "chat":
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
    else:
        limit = body.get("max_tokens", COMPLETION_MAX_TOKENS)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0 else None


# The router's copy of the engine's `kv_transfer_params` forms (tandem_engine/kv_transfer/messages.py):
# the router imports no engine code. tests/engine/kv_transfer/test_kv_params_roundtrip.py proves that
# the two copies read each other's JSON.
class RemoteDecodeParams(msgspec.Struct, kw_only=True):
    """Sent to a prefill engine: compute the prompt, then hold its blocks for a remote decode.
    Build it with no arguments; the nulls are part of the form."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None


class RemotePrefillParams(msgspec.Struct, kw_only=True):
    """A prefill engine's answer, handed to decode as received; fields it left out stay left out."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    tp_size: int | msgspec.UnsetType = msgspec.UNSET
    block_size: int | msgspec.UnsetType = msgspec.UNSET
    lease_seconds: float | msgspec.UnsetType = msgspec.UNSET


class PrefillAnswer(msgspec.Struct):
    """The one field the router reads from a prefill engine's completion."""

    kv_transfer_params: RemotePrefillParams | None = None


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ParsedRequest:
    kind: Kind
    raw: bytes
    body: dict[str, Any]
    prompt_text: str
    prompt_tokens: int
    max_tokens: int

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def one_sequence(self) -> bool:
        """One prompt, one sampled sequence: the only shape a remote prefill's KV can serve."""
        prompt = self.body.get("prompt")
        several_prompts = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
        return not several_prompts and all(
            not isinstance(self.body.get(k), int) or self.body[k] <= 1 for k in ("n", "best_of"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content, sort_keys=True)


def parse_request(kind: Kind, raw: bytes) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    tokens: int | None = None
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a list", "messages")
        # The role and content of every message, in order: what the chat template renders, minus markup.
        text = "".join(
            f"<{m.get('role', '')}>{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict)
        )
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of token-id prompts: route by the first
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text = ",".join(map(str, prompt)) + ","
            tokens = len(prompt)
        else:
            raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    max_tokens = token_limit(kind, body)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    return ParsedRequest(
        kind=kind,
        raw=raw,
        body=body,
        prompt_text=text,
        prompt_tokens=tokens if tokens is not None else estimate_tokens(text),
        max_tokens=max_tokens,
    )


def routing_request(
    req: ParsedRequest, block_chars: int, max_blocks: int, session: str | None, hashed: bool = True
) -> RoutingRequest:
    """`hashed=False` when nothing will read the block hashes (no prefix-aware policy, no P/D)."""
    # The model name seeds the chain: two models never share cache blocks.
    seed = str(req.body.get("model", ""))
    hashes = block_hashes(req.prompt_text, block_chars, max_blocks, seed) if hashed else []
    return RoutingRequest(hashes, req.prompt_tokens, req.max_tokens, session)


def prompt_token_ids(tok: PromptTokenizer, req: ParsedRequest) -> list[int] | None:
    """The prompt's token ids as the engine will see them (the first prompt of a batch), or None when
    the engine would refuse the request anyway."""
    body = req.body
    try:
        if req.kind == "chat":
            return tok.chat_ids(body["messages"], bool(body.get("add_generation_prompt", True)), body.get("tools"),
                                body.get("tool_choice"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return tok.prompt_ids(prompt, bool(body.get("add_special_tokens", True)))
    except (ValueError, TypeError, KeyError) as e:
        logger.debug("prompt not tokenized for routing: %s", e)
    return None


def prefill_body(req: ParsedRequest) -> dict[str, Any]:
    """The request sent to a prefill engine (docs/architecture.md, "The P/D request flow", step 2)."""
    body = dict(req.body)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    for key in ("stream_options", "min_tokens", "n", "best_of"):
        body.pop(key, None)
    body["kv_transfer_params"] = msgspec.to_builtins(RemoteDecodeParams())
    return body


def decode_body(req: ParsedRequest, params: RemotePrefillParams) -> dict[str, Any]:
    """The request sent to a decode engine after a remote prefill: the client's, plus prefill's params."""
    return {**req.body, "kv_transfer_params": msgspec.to_builtins(params)}
