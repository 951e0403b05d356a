"""The engine's tokenizer as a torch-free client needs it: the body of GET /tokenizer.

A router keeps an index of the KV blocks every engine holds, keyed by the engine's chained block hashes,
and must hash an incoming request's prompt exactly as the engine will. It cannot load transformers (that
pulls in torch) nor read the model files, so the engine serves what the `tokenizers` library and jinja2
need to reproduce its token ids: the fast tokenizer's JSON, the chat template with the special-token
strings it reads, the KV block size and the name of the hash (docs/contracts.md, "Block hashing").
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem_engine.core.block_pool import HASH_SPEC


class TokenizerSpec(msgspec.Struct, kw_only=True):
    model: str  # the served name
    hash_spec: str  # names the block hash (block_pool.HASH_SPEC)
    block_size: int  # tokens per KV block: only full blocks are hashed
    tokenizer_json: str  # the fast tokenizer's own serialization (`tokenizers.Tokenizer.from_str` reads it)
    chat_template: str | None  # None when the model has no chat template
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: the names the template sees
    # What a conversation with tools (or with calls and results) goes through where the model's own template
    # does not render tools (frontend/chat_templates.py, TOOLS_TEMPLATE); None: the model's.
    tools_chat_template: str | None = None


def tokenizer_spec(tokenizer: Any, model: str, block_size: int, tools_chat_template: str | None = None) -> bytes:
    """The JSON body of GET /tokenizer for a transformers fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: it has no tokenizer.json to serve")
    try:
        # The template transformers renders for a chat without tools (a model may name several).
        template: str | None = tokenizer.get_chat_template()
    except ValueError:  # no chat template
        template = None
    special = {str(k): str(v) for k, v in tokenizer.special_tokens_map.items()}
    spec = TokenizerSpec(model=model, hash_spec=HASH_SPEC, block_size=block_size,
                         tokenizer_json=backend.to_str(), chat_template=template, special_tokens=special,
                         tools_chat_template=tools_chat_template)
    return msgspec.json.encode(spec)
