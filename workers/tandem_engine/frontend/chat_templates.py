"""The chat templates the engine renders with beside the model's own: TOOLS_TEMPLATE, for conversations with
tools where the model's template has none (entrypoints/tools.py parses what it makes the model write; GET
/tokenizer serves it to routers: frontend/tokenizer_spec.py)."""

from __future__ import annotations

# SmolLM2's ChatML, with tools: the tool list in the system turn (after the client's own system message),
# an assistant turn's calls in SmolLM2's list format, a tool result in a turn of its own.
TOOLS_TEMPLATE = """\
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
<|im_start|>system
{% if has_system %}{{ messages[0].content }}

{% endif %}You can call functions. These are the functions you may call, as JSON between <tools></tools>:
<tools>{{ tools | map(attribute='function') | list | tojson }}</tools>

To call functions, answer with nothing but a JSON list of the calls between <tool_call></tool_call>, each call \
with the function's name and its arguments, like this:
<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>
If no function fits the question, answer it in plain text.<|im_end|>
{% elif not has_system -%}
<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if loop.first and has_system and tools -%}
{%- elif message.role == 'assistant' and message.tool_calls -%}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}<tool_call>[
{%- for call in message.tool_calls -%}
{% if not loop.first %}, {% endif %}{"name": {{ call.function.name | tojson }}, "arguments": \
{{ call.function.arguments | tojson }}}
{%- endfor -%}
]</tool_call><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content or '' }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}"""


def tools_template(chat_template: str | None) -> str | None:
    """The template a conversation with tools goes through instead of the model's: TOOLS_TEMPLATE where the
    model's own does not render tools, else None (the model's)."""
    return None if chat_template and "tools" in chat_template else TOOLS_TEMPLATE
