"""The official `openai` client against a real uvicorn server."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.engine.entrypoints.toy_engine import MODEL


def test_openai_client_completions(oai: openai.OpenAI) -> None:
    c = oai.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=2, seed=1)
    assert c.choices[0].text == "bcd" and c.choices[0].finish_reason == "length"
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.tokens == ["b", "c", "d"]
    assert c.choices[0].logprobs.top_logprobs is not None and c.choices[0].logprobs.top_logprobs[0] == {
        "b": -0.5,
        "c": -1.5,
    }
    assert c.usage is not None and c.usage.total_tokens == 6

    chunks = list(
        oai.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, stream=True, stream_options={"include_usage": True}, n=2
        )
    )
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    )
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == {0: "abc", 1: "abc"}
    assert all(
        ch.usage is None for ch in oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
    )


def test_openai_client_chat(oai: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == "ab" and r.choices[0].message.role == "assistant"
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    first = r.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("a", -0.5, [97])
    assert [t.token for t in first.top_logprobs] == ["a", "b"]

    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=2, logprobs=True)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    assert r.choices[0].logprobs.content[1].top_logprobs == []

    stream = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "abc"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openai_client_errors(oai: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert info.value.body is not None and "max_tokens" in str(info.value.body)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="hi", suffix="x")
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=msgs, n=17)
