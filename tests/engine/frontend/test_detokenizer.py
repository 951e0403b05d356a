"""Token text and token bytes from the real SmolLM2 tokenizer (a byte-level BPE): an emoji is split over
several tokens, and each token's logprob entry must carry that token's own bytes, not U+FFFD's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem_engine.frontend.detokenizer import Detokenizer
from tandem_engine.frontend.metrics import EngineMetrics
from tandem_engine.frontend.output_processor import OutputProcessor
from tandem_engine.protocol import EngineCoreOutput, EngineCoreOutputs, Logprobs
from tandem_engine.sampling_params import SamplingParams

TEXT = "Party 🎉 time"
PARTY = "🎉".encode()  # F0 9F 8E 89


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    loader = pytest.importorskip("tandem_engine.models.loader")
    try:
        return loader.load_config_and_tokenizer(loader.resolve_model("smollm2-135m-instruct"))[1]
    except Exception as exc:  # the embedded model is an optional package
        pytest.skip(f"smollm2 not available: {exc}")


def test_token_bytes_of_a_split_emoji(tokenizer: Any) -> None:
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [detok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == TEXT.encode()
    # The emoji's tokens: each alone is not valid UTF-8, so its text is U+FFFD, but its bytes are its own.
    emoji = [i for i, p in enumerate(pieces) if not _is_utf8(p)]
    assert len(emoji) >= 2 and b"".join(pieces[i] for i in emoji).strip() == PARTY
    for i in emoji:
        assert detok.token_text(ids[i]).strip() == "\ufffd"
    for i, tid in enumerate(ids):
        if i not in emoji:
            assert pieces[i] == detok.token_text(tid).encode()
    # Special tokens are their own text.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert detok.token_bytes(im_end) == b"<|im_end|>"


def test_text_stream_holds_partial_characters(tokenizer: Any) -> None:
    detok = Detokenizer(tokenizer)
    stream = detok.text_stream(skip_special_tokens=True)
    pieces = [stream.step(t) for t in tokenizer.encode(TEXT, add_special_tokens=False)]
    assert "".join(p for p in pieces if p) == TEXT
    assert "\ufffd" not in "".join(p for p in pieces if p)


async def test_output_processor_logprobs_carry_token_bytes(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(tokenizer, EngineMetrics("m"))
    queue = proc.add_request("r", [5, 6, 7], SamplingParams(max_tokens=len(ids), logprobs=1))
    top_ids = [[t] for t in reversed(ids)]  # the alternatives: other tokens of the same text
    lp = Logprobs(sampled=[-0.5] * len(ids), top_ids=top_ids, top_logprobs=[[-1.0]] * len(ids))
    proc.process(EngineCoreOutputs(0, [EngineCoreOutput("r", ids, lp, finish_reason="length")]))
    out = await asyncio.wait_for(queue.get(), 1)
    assert not isinstance(out, BaseException) and out.text == TEXT and out.logprobs is not None
    assert [lp.token_id for lp in out.logprobs] == ids
    assert b"".join(lp.token_bytes for lp in out.logprobs) == TEXT.encode()
    assert b"".join(lp.top[0].token_bytes for lp in reversed(out.logprobs)) == TEXT.encode()
    tokens = tokenizer.convert_ids_to_tokens(ids)
    for lp, token in zip(out.logprobs, tokens, strict=True):
        assert lp.token == tokenizer.decode([lp.token_id])  # the text stays the decoded piece
        assert lp.token_bytes == bytes(_GPT2_BYTES[c] for c in token)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _gpt2_bytes() -> dict[str, int]:
    """The byte-level alphabet, written out independently of the helper under test."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(0x100 + n): b for n, b in enumerate(moved)})
    return table


_GPT2_BYTES = _gpt2_bytes()


# ------------------------------------------------------------------------- token ids follow their text


def run_processor(tokenizer: Any, prompt: list[int], ids: list[int], **params: Any) -> list[Any]:
    """Feed `ids` one per step, the last one finishing by length; return every RequestOutput."""
    proc = OutputProcessor(tokenizer, EngineMetrics("m"))
    queue = proc.add_request("r", prompt, SamplingParams(max_tokens=len(ids), **params))
    for i, tid in enumerate(ids):
        proc.process(EngineCoreOutputs(0, [EngineCoreOutput("r", [tid], finish_reason=(
            "length" if i == len(ids) - 1 else None))]))
    outs = []
    while not queue.empty():
        outs.append(queue.get_nowait())
        if outs[-1].finished:
            break
    return outs


def test_each_delta_carries_the_ids_of_exactly_its_text(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    outs = run_processor(tokenizer, prompt, ids)
    assert "".join(o.text for o in outs) == TEXT and [t for o in outs for t in o.token_ids] == ids
    for o in outs:
        assert o.text == tokenizer.decode(o.token_ids)  # held-back bytes of the emoji come with their text
    assert max(len(o.token_ids) for o in outs) >= 3  # the emoji's tokens arrive together
    assert any(not o.token_ids for o in outs)  # and the steps that only held bytes reported nothing


def test_a_stop_string_holds_its_tokens_back_until_the_end(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    outs = run_processor(tokenizer, [1], ids, stop=["thre"])
    final = outs[-1]
    assert final.finished and final.stop_reason == "thre"
    assert "".join(o.text for o in outs) == "one two "
    for o in outs[:-1]:  # before the end: exactly the text of the ids, never part of a possible stop
        assert o.text == tokenizer.decode(o.token_ids)
    # The final delta reports every remaining id, those of the stop string (whose text is not shown) too.
    stopped_at = next(n for n in range(1, len(ids) + 1) if "thre" in tokenizer.decode(ids[:n]))
    assert [t for o in outs for t in o.token_ids] == ids[:stopped_at]
    assert "thre" in tokenizer.decode(final.token_ids)


def test_a_resumed_request_continues_the_text_exactly(tokenizer: Any) -> None:
    """Prompt + the first k output ids, resumed: its text continues the first part's, also when the
    first part ends inside the emoji (whose bytes then come out whole with the resumed part)."""
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    full = "".join(o.text for o in run_processor(tokenizer, prompt, ids))
    inside = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert inside, "the emoji should be split over tokens"
    for k in range(1, len(ids)):
        first = "".join(o.text for o in run_processor(tokenizer, prompt, ids[:k]))
        rest = "".join(o.text for o in run_processor(tokenizer, prompt + ids[:k], ids[k:]))
        assert first + rest == full, k
        if k in inside:
            assert "\ufffd" not in first and rest.lstrip().startswith("🎉")
