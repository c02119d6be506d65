"""Rendering a chat completions body into the prompt text, exactly as vLLM and transformers do.

Split from prompt_tokens.py (which tokenises that text, with segment_cache.py) because this is a
separate idea with its own reference: what vLLM's chat parser hands the template (content parts
joined with ``"\\n"`` in the "string" content format, kept as text parts in the "openai" format,
which vLLM detects from the template as it does; tools and tool_calls as vLLM dumps them) and how
transformers' ``apply_chat_template`` renders it (sandboxed jinja2, ``tojson``,
``raise_exception``, ``strftime_now``, the special tokens, ``add_generation_prompt``,
``chat_template_kwargs``), with the tail cut for ``continue_final_message`` as transformers does.

Pure: no I/O; a request it cannot render raises :class:`NotTokenizable`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, Literal

from extproc.pick.tokens.not_tokenizable import NotTokenizable

# -- the chat template environment (transformers' utils/chat_template_utils.py) --------------------

def compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers' tag)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            body: str = caller()
            return body

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    template = env.from_string(source)
    # The template's globals are a ChainMap over the environment's, copied into every render's
    # context key by key (~1/3 of a short template's render); the same names, flattened once.
    template.globals = dict(template.globals)
    return env, template


def detect_content_format(env: Any, source: str) -> Literal["string", "openai"]:
    """vLLM's "auto" content format (vllm/renderers/hf.py ``_detect_content_format``): "openai"
    when the template loops over a message's ``content``, else "string"."""
    import jinja2.nodes as n

    try:
        root = env.parse(source)
    except Exception:  # noqa: BLE001 - vLLM falls back to "string" too
        return "string"

    def is_var(node: Any, name: str) -> bool:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name == name

    def is_attr(node: Any, name: str, key: str) -> bool:
        if isinstance(node, n.Getitem):
            return is_var(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
        if isinstance(node, n.Getattr):
            return is_var(node.node, name) and node.attr == key
        return False

    def is_var_or_elems(node: Any, name: str, key: str | None = None) -> bool:
        if isinstance(node, n.Filter):
            return node.node is not None and is_var_or_elems(node.node, name, key)
        if isinstance(node, n.Test):
            return is_var_or_elems(node.node, name, key)
        if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
            return is_var_or_elems(node.node, name, key)
        return is_attr(node, name, key) if key else is_var(node, name)

    messages_vars = ["messages"]
    queue = ["messages"]
    while queue:
        var = queue.pop(0)
        for assign in root.find_all(n.Assign):
            if is_var_or_elems(assign.node, var) and isinstance(assign.target, n.Name):
                messages_vars.append(assign.target.name)
                if assign.target.name != var:
                    queue.append(assign.target.name)
    message_vars = [loop.target.name for loop in root.find_all(n.For)
                    if isinstance(loop.target, n.Name) and any(is_var_or_elems(loop.iter, v) for v in messages_vars)]
    for loop in root.find_all(n.For):
        if any(is_var_or_elems(loop.iter, v, "content") for v in message_vars):
            return "openai"
    return "string"


def token_text(value: Any) -> str | None:
    """A special token's text in tokenizer_config.json (a string or an added-token object)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    raise TypeError(f"expected a string or a {{'content': ...}} object, got {value!r}")


_TEXT_PART_TYPES: Final = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_MEDIA_KEYS: Final = frozenset({"image_url", "input_image", "image_embeds", "image_pil", "audio_url",
                                "input_audio", "audio_embeds", "video_url", "video_embeds", "prompt_embeds"})


# -- a chat completions body, rendered (vLLM's chat parser, then transformers) ---------------------

def render_chat(template: Any, special_tokens: Mapping[str, Any], content_format: Literal["string", "openai"],
                doc: Mapping[str, Any]) -> str:
    """The chat template (compiled by :func:`compile_template`, None when the model has none)
    rendered for a chat completions body, as vLLM renders it."""
    if template is None:
        raise NotTokenizable("no_tokenizer", "the model has no chat template")
    if doc.get("chat_template") is not None:
        raise NotTokenizable("unsupported", "a per-request chat_template")
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotTokenizable("bad_request", "messages is not a non-empty list")
    add_generation_prompt = request_bool(doc, "add_generation_prompt", True)
    continue_final = request_bool(doc, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        # vLLM's request validator: "Cannot set both `continue_final_message` and
        # `add_generation_prompt` to True."
        raise NotTokenizable("bad_request", "continue_final_message with add_generation_prompt")
    conversation = [parse_message(m, content_format) for m in messages]
    tools = doc.get("tools")
    if tools is not None:
        tools = _tools_as_vllm_dumps(tools)

    kwargs = doc.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise NotTokenizable("bad_request", "chat_template_kwargs is not an object")
    if {"chat_template", "tokenize"} & kwargs.keys():
        raise NotTokenizable("bad_request", "chat_template_kwargs has chat_template or tokenize")
    # vLLM: the request's chat_template_kwargs, overridden by the request's own fields (None
    # values dropped); then transformers: the special tokens, overridden by those kwargs.
    extra: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                             "continue_final_message": continue_final}
    for key in ("documents", "reasoning_effort"):
        if doc.get(key) is not None:
            extra[key] = doc[key]
    if doc.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = doc["reasoning_effort"] != "none"
    merged = {**kwargs, **{k: v for k, v in extra.items() if v is not None and v != "auto"}}
    variables: dict[str, Any] = {**special_tokens, **merged}
    # transformers handles continue_final_message after rendering; the template does not see it.
    variables.pop("continue_final_message", None)
    variables.pop("return_assistant_tokens_mask", None)
    for key in ("messages", "tools", "documents"):
        variables.pop(key, None)
    try:
        text: str = template.render(messages=conversation, tools=tools, documents=merged.get("documents"),
                               **variables)
    except Exception as e:  # noqa: BLE001 - TemplateError, UndefinedError, TypeError, ...
        raise NotTokenizable("template_error", f"{type(e).__name__}: {e}") from e
    if continue_final:
        text = _cut_after_final_message(text, conversation[-1])
    return text


def plain_role(message: Any) -> str | None:
    """The role of a common message, ``{"role": str, "content": str}`` and not a developer's (which
    also gets ``tools``), else None: the shape taken without the general walk (and spliced,
    extproc.pick.tokens.chat_splice)."""
    if type(message) is dict and len(message) == 2:
        role = message.get("role")
        if type(role) is str and type(message.get("content")) is str and role != "developer":
            return role
    return None


def parse_message(message: Any, content_format: Literal["string", "openai"]) -> dict[str, Any]:
    """One message as vLLM's chat parser hands it to the template."""
    role = plain_role(message)
    if role is not None:  # the general walk's result, without the walk
        if content_format == "string" or role == "tool":
            return {"role": role, "content": message["content"]}
        return {"role": role, "content": [{"type": "text", "text": message["content"]}]}
    return _parse_message(message, content_format)


def _parse_message(message: Any, content_format: Literal["string", "openai"]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise NotTokenizable("bad_request", "a message without a role")
    role = message["role"]
    content = message.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = []  # one text part, taken as the loop below would take it (the common case, no loop)
    elif isinstance(content, list):
        parts = content
    else:
        raise NotTokenizable("bad_request", "content is neither a string nor a list of parts")
    texts: list[Any] = []
    if isinstance(content, str) and (content or content_format != "string"):
        texts.append(content if content_format == "string" else {"type": "text", "text": content})
    for part in parts:
        if isinstance(part, str):
            texts.append(part if content_format == "string" else {"type": "text", "text": part})
            continue
        if not isinstance(part, Mapping):
            raise NotTokenizable("bad_request", "a content part that is not an object")
        ptype = part.get("type")
        if ptype in _TEXT_PART_TYPES and not (_MEDIA_KEYS & part.keys()):
            value = part.get(_TEXT_PART_TYPES[ptype])
            if value is None:
                continue  # vLLM skips text parts without text
            if not isinstance(value, str):
                raise NotTokenizable("bad_request", "a text part whose text is not a string")
            if content_format == "string":
                if value:
                    texts.append(value)
            else:
                extra = {k: v for k, v in part.items() if k not in ("type", "text", "refusal")}
                texts.append({"type": "text", "text": value, **extra})
            continue
        if ptype in _MEDIA_KEYS or (_MEDIA_KEYS & part.keys()) or ptype is None:
            raise NotTokenizable("multimodal", f"a {ptype or 'media'} part")
        raise NotTokenizable("unsupported", f"content part type {ptype!r}")
    out: dict[str, Any] = {"role": role}
    if content_format == "string":
        out["content"] = "\n".join(texts)
    else:
        out["content"] = texts
        if role == "tool" and all(isinstance(t, Mapping) and t.get("type") == "text" for t in texts):
            out["content"] = "\n".join(t["text"] for t in texts)
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            tool_calls = _tool_calls_as_vllm(tool_calls)
            if tool_calls:
                out["tool_calls"] = tool_calls
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def request_bool(doc: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean field of the request body (``default`` when absent or null)."""
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise NotTokenizable("bad_request", f"{key} is not a boolean")
    return value


def _tools_as_vllm_dumps(tools: Any) -> list[dict[str, Any]]:
    """``[tool.model_dump() for tool in request.tools]``: description and parameters present
    (None when absent), unknown fields kept after the known ones."""
    if not isinstance(tools, list):
        raise NotTokenizable("bad_request", "tools is not a list")
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise NotTokenizable("bad_request", "a tool without a function")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise NotTokenizable("bad_request", "a tool function without a name")
        dumped_fn = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        dumped_fn.update({k: v for k, v in fn.items()
                          if k not in dumped_fn and not (k == "defer_loading" and v is None)})
        dumped = {"type": tool.get("type", "function"), "function": dumped_fn}
        dumped.update({k: v for k, v in tool.items() if k not in dumped and not (k == "defer_loading" and v is None)})
        out.append(dumped)
    return out


def _tool_calls_as_vllm(tool_calls: Any) -> list[dict[str, Any]]:
    """vLLM's ``_postprocess_messages``: arguments parsed from JSON into an object ({} when empty,
    invalid or not an object)."""
    if not isinstance(tool_calls, list):
        raise NotTokenizable("bad_request", "tool_calls is not a list")
    out = []
    for call in tool_calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping) \
                or call.get("type", "function") != "function":
            raise NotTokenizable("bad_request", "a tool call that is not a function call")
        fn = dict(call["function"])
        args = fn.get("arguments")
        if not args:
            fn["arguments"] = {}
        elif not isinstance(args, dict):
            parsed = args
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except (ValueError, RecursionError):  # invalid, or nested deeper than Python's stack
                    parsed = None
            fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        out.append({**call, "function": fn})
    return out


def _cut_after_final_message(text: str, final: Mapping[str, Any]) -> str:
    """transformers' ``continue_final_message``: end the text right after the final message."""
    content = final.get("content")
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, Mapping) and "text" in block:
                content = block["text"]
                break
        else:
            raise NotTokenizable("bad_request", "continue_final_message: no text in the final message")
    if not isinstance(content, str) or content.strip() not in text:
        raise NotTokenizable("template_error", "continue_final_message: the final message is not in the rendered chat")
    at = text.rindex(content.strip())
    if text[at:at + len(content.lstrip())] == content:
        return text[:at + len(content.lstrip())]
    return text[:at + len(content.strip())]
