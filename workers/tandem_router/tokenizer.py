"""The engine's prompt tokens, computed in the router: token ids, then the engine's KV block hashes.

The router cannot load transformers (it pulls in torch) and has no model files, so it asks an engine for
its tokenizer (GET /tokenizer: the fast tokenizer's JSON, the chat template, the special-token strings,
the block size and the name of the block hash) and reproduces the engine's prompts with the `tokenizers`
library and jinja2: a completions prompt is encoded as the engine encodes it (special tokens added unless
the request says otherwise), chat messages are rendered by the template as the engine renders them for
/v1/chat/completions, then encoded without special tokens. docs/contracts.md, "Block hashing", is the
spec; tests/router/test_tokenizer.py holds every answer against a live engine's.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from typing import Any

import aiohttp
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tandem_router.hashing import BLOCK_HASH_SPEC, token_block_hashes

# Names a message's reasoning may come under; transformers hands templates the first under each name.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# The router's copy of the engine's GET /tokenizer body (tandem_engine/frontend/tokenizer_spec.py): the
# router imports no engine code; tests/router/test_tokenizer.py reads the engine's answer with it.
class TokenizerSpec(msgspec.Struct, kw_only=True):
    model: str
    hash_spec: str
    block_size: int
    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str]
    tools_chat_template: str | None = None


def template_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools as the engine hands them to its template (none when the choice is `none` or there are no
    tools): each function's name, parameters (an empty object schema by default) and description."""
    if not isinstance(tools, list) or not tools or tool_choice == "none":
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise ValueError("tools: each is a function")
        description = fn.get("description")
        out.append({"type": "function", "function": {
            "name": fn.get("name"), "parameters": fn.get("parameters", {"type": "object", "properties": {}}),
            **({"description": description} if isinstance(description, str) and description else {})}})
    return out


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's calls with their `arguments` JSON text read into objects, as the engine does."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        fixed.append(c)
    return {**message, "tool_calls": fixed}


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders
    its body unchanged (some templates use it, and would not parse without it)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Templates expect plain JSON: jinja's own tojson escapes <, >, & and ' for HTML.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox set up as Hugging Face chat templates expect (their whitespace control and helpers)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(i: int, content: Any) -> str:
    """Text parts joined by newlines, as the engine serves them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}]: content is a string or a list of parts")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}]: only text content parts are served")
        texts.append(part["text"])
    return "\n".join(texts)


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Request messages as the engine hands them to its template: keys with null values dropped, `role`,
    `content` and `name` first, content parts flattened to text, reasoning under each of its names."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role")
        first = {k: msg[k] for k in ("role", "content", "name") if msg.get(k) is not None}
        item = first | {k: v for k, v in msg.items() if v is not None and k not in first}
        if "content" in item:
            item["content"] = _content_text(i, item["content"])
        reasoning = next((item[k] for k in REASONING_FIELDS if item.get(k) is not None), None)
        if reasoning is not None:
            item = {"thinking": reasoning, **item, "reasoning_content": reasoning}
        out.append(item)
    return out


class PromptTokenizer:
    """Token ids and block hashes of requests, as one engine (of the model in `spec`) computes them."""

    def __init__(self, spec: TokenizerSpec) -> None:
        if spec.hash_spec != BLOCK_HASH_SPEC:
            raise ValueError(f"the engine hashes blocks as {spec.hash_spec!r}; this router as {BLOCK_HASH_SPEC!r}")
        self.spec = spec
        self.model = spec.model
        self.block_size = spec.block_size
        self._tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        self._template = None if spec.chat_template is None else chat_environment().from_string(spec.chat_template)
        self._tools_template = None if spec.tools_chat_template is None \
            else chat_environment().from_string(spec.tools_chat_template)

    @classmethod
    def from_json(cls, body: bytes | str) -> PromptTokenizer:
        return cls(msgspec.json.decode(body, type=TokenizerSpec))

    def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A completions prompt's token ids: text is encoded, a list of token ids is the prompt itself."""
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt is a string or a list of token ids")

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, tools: Any = None,
                    tool_choice: Any = None) -> str:
        """The prompt text, as the engine renders it: a conversation with tools, or with calls and results in it,
        through the engine's tools template where it names one (docs/contracts.md, "Tool calling")."""
        listed = template_tools(tools, tool_choice)
        rendered = [_arguments_as_objects(m) for m in template_messages(messages)]
        with_tools = listed is not None or any(m.get("role") == "tool" or m.get("tool_calls") for m in rendered)
        template = self._tools_template if with_tools and self._tools_template is not None else self._template
        if template is None:
            raise ValueError(f"{self.model} has no chat template")
        try:
            return template.render(messages=rendered, tools=listed, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.spec.special_tokens)
        except jinja2.TemplateError as exc:
            raise ValueError(f"could not apply the chat template: {exc}") from None

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True, tools: Any = None,
                 tool_choice: Any = None) -> list[int]:
        """A chat request's prompt token ids. Raises ValueError where the engine answers 400."""
        # The template wrote BOS and every other special token it wants.
        text = self.render_chat(messages, add_generation_prompt, tools, tool_choice)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The engine's prefix-cache keys of the prompt's full blocks."""
        return token_block_hashes(token_ids, self.block_size)


async def fetch_tokenizer(url: str, session: aiohttp.ClientSession | None = None,
                          timeout_s: float = 30.0) -> PromptTokenizer:
    """GET `url`/tokenizer from an engine (reusing `session` when given) and build its PromptTokenizer."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    if session is None:
        async with aiohttp.ClientSession(timeout=timeout) as own:
            return await fetch_tokenizer(url, own, timeout_s)
    async with session.get(url.rstrip("/") + "/tokenizer", timeout=timeout) as resp:
        resp.raise_for_status()
        body = await resp.read()
    # Parsing the ~2 MB tokenizer takes a while: off the event loop.
    return await asyncio.to_thread(PromptTokenizer.from_json, body)
