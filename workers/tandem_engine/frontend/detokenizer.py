"""Token ids to text and bytes, through the tokenizer's public API only: the incremental text of a
request's output, and the text and raw bytes of one token for logprobs.

A request's output is decoded after the last few tokens of its prompt, as the tokenizer would decode
prompt and output together: a tokenizer that drops the leading space of a text's first word keeps it
here, and a character whose first bytes end the prompt (a request resumed mid-character) comes out
whole with the output token that completes it.

A byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) splits a character such as an emoji over several tokens.
Decoded alone, such a token is U+FFFD; its own bytes come from its vocabulary string, in which GPT-2's
byte-to-unicode alphabet stands for each byte. OpenAI's `bytes` field reports those bytes, so that a
client can join consecutive tokens back into the character.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table reversed: printable bytes stand for themselves, the other bytes
    (controls, space, DEL, NBSP, soft hyphen) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


# Prompt tokens decoded before the output: enough to settle a word's leading space or finish a character.
CONTEXT_TOKENS = 6


class TextStream:
    """One request's output text, token by token; a character split over tokens appears whole, once its
    last token has arrived."""

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool, context: list[int] | None = None) -> None:
        self._backend = backend
        context = (context or [])[-CONTEXT_TOKENS:]
        # The context up to its last whole character primes the stream; the tokens of a character it
        # leaves unfinished are stepped through, so the output token that completes it emits it.
        whole = len(context)
        while whole > 0 and backend.decode(context[:whole], skip_special_tokens=skip_special_tokens
                                           ).endswith("\ufffd"):
            whole -= 1
        self._stream = DecodeStream(context[:whole], skip_special_tokens=skip_special_tokens)
        for token_id in context[whole:]:
            self._stream.step(backend, token_id)

    def step(self, token_id: int) -> str | None:
        """The text this token completes, or None while a character is still incomplete."""
        piece: str | None = self._stream.step(self._backend, token_id)
        return piece


class Detokenizer:
    """Built from a `transformers` fast tokenizer (`backend_tokenizer`, `decode`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend: Tokenizer = tokenizer.backend_tokenizer
        self._byte_level = isinstance(self._backend.decoder, ByteLevel)
        # Added tokens (<|im_end|>, ...) are stored as their text, not in the byte-level alphabet.
        self._added = set(self._backend.get_added_tokens_decoder())
        self._bytes: dict[int, bytes] = {}

    def text_stream(self, skip_special_tokens: bool, context: list[int] | None = None) -> TextStream:
        """The output text of a request whose prompt is `context`."""
        return TextStream(self._backend, skip_special_tokens, context)

    def token_text(self, token_id: int) -> str:
        """The token decoded alone: U+FFFD where it holds only part of a character."""
        return str(self._tokenizer.decode([token_id]))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: part of a character's UTF-8 where the token splits one."""
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._lookup_bytes(token_id)
        return data

    def _lookup_bytes(self, token_id: int) -> bytes:
        if self._byte_level and token_id not in self._added:
            piece = self._backend.id_to_token(token_id)
            if piece is not None and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        return self.token_text(token_id).encode("utf-8")
