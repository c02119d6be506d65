"""The simulator's fixed chat template: messages -> one prompt string.

Documented in docs/simulator.md. The order matches what real templates feed to the
model (tools first, then messages in order, then the generation prompt), so a router
that keys on "tools + messages" sees the same prefix structure the replica caches::

    <|tools|>\n{canonical JSON of tools}<|end|>\n          (only if tools are given)
    <|{role}|>\n{content}<|end|>\n                        (per message)
    <|{role}:{name}|>\n...                                (when the message has a name)
    <|{role}#{tool_call_id}|>\n...                        (tool results; after the name)
    ...{content}<|tool_calls|>{canonical JSON}<|end|>\n     (when it has tool_calls)
    <|assistant|>\n                                       (add_generation_prompt, default)

Content may be a string, null, or a list of parts; text parts are joined with "\n"
(vLLM's "string" content format); other parts render as ``<|{type}|>``. Canonical JSON
is sorted keys, no whitespace (orjson).
"""

from __future__ import annotations

from typing import Any

import orjson


class TemplateError(ValueError):
    """The messages cannot be rendered (becomes a 400)."""


def canonical_json(value: Any) -> str:
    """Key-order and whitespace independent JSON text."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")


def render_content(content: Any) -> str:
    """Flatten a message's content (string / null / list of parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces: list[str] = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict):
                kind = part.get("type", "text")
                if kind == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise TemplateError("text content part needs a string 'text'")
                    pieces.append(text)
                else:
                    pieces.append(f"<|{kind}|>")
            else:
                raise TemplateError("content parts must be objects")
        return "\n".join(pieces)
    raise TemplateError("message content must be a string, null or a list of parts")


def render(
    messages: Any,
    tools: Any = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render a chat request to the prompt text the tokenizer sees."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("'messages' must be a non-empty list")
    out: list[str] = []
    if tools:
        out.append(f"<|tools|>\n{canonical_json(tools)}<|end|>\n")
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TemplateError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError("each message needs a string 'role'")
        name = msg.get("name")
        tag = f"{role}:{name}" if isinstance(name, str) and name else role
        body = render_content(msg.get("content"))
        tool_calls = msg.get("tool_calls")
        if tool_calls:
            body += f"<|tool_calls|>{canonical_json(tool_calls)}"
        tool_call_id = msg.get("tool_call_id")
        if isinstance(tool_call_id, str) and tool_call_id:
            tag += f"#{tool_call_id}"
        if continue_final_message and i == last:
            out.append(f"<|{tag}|>\n{body}")
        else:
            out.append(f"<|{tag}|>\n{body}<|end|>\n")
    if add_generation_prompt and not continue_final_message:
        out.append("<|assistant|>\n")
    return "".join(out)
