"""The tokenizer a GGUF file's `tokenizer.*` metadata describes, built directly with `tokenizers`.

Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2") that split text with GPT-2's own pattern are
built here: the vocabulary and merges as the file lists them, GPT-2's byte-level pre-tokenizer and
decoder, the tokens the file marks as control as special tokens (kept whole, skipped when decoding) and
those marked user-defined as plain added tokens, and the special tokens, the BOS/EOS flags and the chat
template from the metadata. This is the tokenizer transformers' GGUF conversion gives for such a file
(tests/engine/models/test_gguf_file.py checks the ids on a prompt set). Other vocabularies return None:
the loader then runs transformers' conversion once, when it builds the cache (docs/architecture.md,
"Start-up and the model cache").
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# llama.cpp's pre-tokenizer names whose split transformers' conversion leaves at GPT-2's ByteLevel regex.
GPT2_SPLIT_PRE_TOKENIZERS = frozenset({"default", "gpt2", "smollm"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def builds_tokenizer(metadata: dict[str, Any]) -> bool:
    """Whether `build_tokenizer` handles this file's vocabulary."""
    return (metadata.get("tokenizer.ggml.model") == "gpt2"
            and metadata.get("tokenizer.ggml.pre", "default") in GPT2_SPLIT_PRE_TOKENIZERS
            and "tokenizer.ggml.merges" in metadata)


def _byte_level_spelling(tokens: list[str]) -> list[str]:
    """Tokens as byte-level BPE spells them. Files normally store them so already; one holding another
    character is written out byte by byte in the byte alphabet."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [t if set(t) <= alphabet else "".join(p for p, _ in spell.pre_tokenize_str(t)) for t in tokens]


def build_tokenizer(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    """The tokenizer of a file `builds_tokenizer` accepts."""
    if not builds_tokenizer(metadata):
        raise ValueError(f"no built-in tokenizer for GGUF vocabulary {metadata.get('tokenizer.ggml.model')!r} "
                         f"with pre-tokenizer {metadata.get('tokenizer.ggml.pre')!r}")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    spelled = _byte_level_spelling(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # A "control" token outside the byte alphabet is a mislabelled ordinary token: adding it whole would
    # change how text containing it splits.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types, strict=False)
                            if kind == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, s, kind in zip(tokens, spelled, types, strict=False)
                    if kind == _USER_DEFINED and t == s])

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    out = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=token("bos"), eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    )
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        out.chat_template = template
    return out
