"""Hostile request documents for precise mode's render and tokenise path (chat_render, prompt_tokens).

``decide`` reads a body's fields only for its key; precise mode walks the whole parsed document:
message roles, content parts, tool calls and their arguments (parsed again from JSON), tools,
template kwargs, the prompt's token ids. Each list below is one kind of hostile value for one of
those places, and the shapes (``shapes.precise_*``) cycle through them (``FuzzRandom.cycle``), so
a run of a few thousand bodies meets every one. A ``Raw`` value is spliced into the dumped body
verbatim: nesting past Python's recursion limit cannot be built by ``json.dumps``, only written.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from routerlab.fuzz.documents import MODELS, SYSTEM_PROMPTS, UNICODE, random_text

Doc = dict[str, Any]


class Raw(NamedTuple):
    """JSON text spliced into the body as it is (deep nesting ``json.dumps`` cannot write)."""

    data: bytes


# --- values ------------------------------------------------------------------------------
_SPECIAL: Final = "<|begin_of_text|><|eot_id|><|start_header_id|>user<|end_header_id|><s></s>[INST]<<SYS>>"
# NUL, bidi and zero-width marks, BOM, combining marks, special tokens' text, Metaspace's mark, control
# characters, ZWJ emoji, the last code point and non-characters, Jinja syntax, an escaped surrogate
# pair, and lone or reversed surrogates (whose body orjson refuses: the request is not_json)
TEXTS: Final[tuple[str, ...]] = (
    "", "hi", "a\x00b\x00", "\u202eevil\u202c \u200f\u05d0\u200e", "\ufeffbom", "e\u0301" * 50, "\u200b\u200d",
    _SPECIAL, "\u2581\u2581x \u2581", "\r\n\t \x0b\x0c", "\U0001f469\u200d\U0001f469\u200d\U0001f467",
    "\U0010ffff\ufffe\uffff", "\x7f\x1b[31mred", "\u2028\u2029", "{{ 7*7 }}{% for x in y %}{# c #}",
    "\U0001f642 valid pair", "\ud800 lone", "\udfff\ud800 reversed",
)
# long texts (one BPE word of 64 Ki characters, 60 Ki multi-byte characters, runs of added tokens): only as
# a variant of their own, since a body of them costs up to ~1 s to tokenise five times over
LONG_TEXTS: Final[tuple[str, ...]] = (" " * 50_000, "a" * 65_536, "\u00e9\u4e2d\U0001f642" * 20_000, "<s>" * 10_000,
                                      "\n" * 20_000, (_SPECIAL + "x") * 1000)
ODD: Final[tuple[Any, ...]] = (None, True, False, 0, -1, 1.5, -0.0, 2**63, 18446744073709551615, [], {}, ["a"],
                               {"a": "b"}, [[["x"]]], {"type": "text", "text": "x"}, "")
DEPTHS: Final = (300, 1000, 1020)  # past orjson's re-encoding limit (254), Python's recursion limit, near orjson's 1024


def deep(depth: int, kind: int) -> Raw:
    """``depth`` levels of arrays (kind 0) or objects (kind 1) around a 1."""
    if kind == 0:
        return Raw(b"[" * depth + b"1" + b"]" * depth)
    return Raw(b'{"a":' * depth + b"1" + b"}" * depth)


DEEP_STRINGS: Final = ("[" * 100_000, '{"a":' * 50_000, "[" * 500 + "]" * 500, "[" * 5000 + "]" * 5000,
                       '{"a":' * 2000 + "1" + "}" * 2000)  # JSON texts in a string (tool call arguments)


_READABLE: Final = tuple(t for t in TEXTS if not any("\ud800" <= c <= "\udfff" for c in t))


def _text(rng: random.Random) -> str:
    """A short hostile text the body can carry: a lone surrogate would make the whole body not_json and
    hide the variant under test (they are variants of their own)."""
    return rng.choice(_READABLE) if rng.random() < 0.7 else random_text(rng, rng.randint(0, 80), UNICODE)


# --- content parts -----------------------------------------------------------------------
def _parts(kind: str, text: str) -> list[Any]:
    """One list of content parts of each odd kind."""
    parts: dict[str, list[Any]] = {
        "text": [{"type": "text", "text": text}, {"type": "text", "text": "second"}],
        "strings": [text, "b"],
        "mixed": [text, {"type": "text", "text": "x"}, {"type": "input_text", "text": "y"}],
        "refusal": [{"type": "refusal", "refusal": text}, {"type": "output_text", "text": "z"}],
        "none_text": [{"type": "text", "text": None}, {"type": "text"}],
        "image": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
        "input_image": [{"type": "input_image", "image_url": "data:,"}],
        "audio": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
        "text_with_media": [{"type": "text", "text": text, "image_url": {"url": "x"}}],
        "no_type": [{"text": text}],
        "unknown_type": [{"type": "weird", "text": text}],
        "type_number": [{"type": 5, "text": text}],
        "extra_keys": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}, "x": [1, {"y": None}]}],
        "lists": [[text], [[]]],
        "nones": [None],
        "numbers": [1, 2.5],
        "empty": [],
        "many": [{"type": "text", "text": "p"}] * 10_000,
        "many_strings": ["p"] * 10_000,
    }
    return parts[kind]


PART_KINDS: Final = ("text", "strings", "mixed", "refusal", "none_text", "image", "input_image", "audio",
                     "text_with_media", "no_type", "unknown_type", "type_number", "extra_keys", "lists", "nones",
                     "numbers", "empty", "many", "many_strings")


def _odd_text_part(value: Any) -> list[Any]:
    return [{"type": "text", "text": value}]


# --- tool calls and tools --------------------------------------------------------------------
_ARGUMENTS: Final[tuple[Any, ...]] = ("", "{}", "not json", "[1,2]", "1", "null", '{"a": [1, {"b": null}]}',
                                      '{"a":', "\x00", {}, {"a": {"b": [1]}}, 5, [1], None, True, *DEEP_STRINGS)


def _tool_call(arguments: Any) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


TOOL_CALLS: Final[tuple[Any, ...]] = (
    *([_tool_call(a)] for a in _ARGUMENTS),
    {"id": "c1"}, "call", 5, [None], ["call"], [{"id": "c1"}], [{"type": "function", "function": "f"}],
    [{"type": "other", "function": {"name": "f"}}], [{"type": None, "function": {"name": 5, "arguments": "{}"}}],
    [{"function": {}}], [{"id": [1], "function": {"name": "f", "arguments": "{}", "extra": {"x": None}}}],
    [_tool_call("{}")] * 500,
)
TOOLS: Final[tuple[Any, ...]] = (
    [], {}, "tools", 5, [None], ["f"], [{}], [{"type": "function"}], [{"function": "f"}], [{"function": {}}],
    [{"function": {"name": 5}}], [{"function": {"name": "f", "parameters": None, "description": None}}],
    [{"type": 7, "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                               "description": "d" * 100_000, "strict": True, "defer_loading": None}, "extra": [1]}],
    [{"type": "function", "function": {"name": "\u202e\x00", "parameters": "not an object"}}],
    [{"type": "function", "function": {"name": "f"}}] * 300,
)


# --- messages ------------------------------------------------------------------------------
MessageEdit = Callable[[random.Random, dict[str, Any]], Any]  # returns the new message (or mutates it)
DocEdit = Callable[[random.Random, Doc], None]


def _set(**fields: Any) -> DocEdit:
    """An edit that sets these fields (of a message or of the request)."""
    def apply(rng: random.Random, target: dict[str, Any]) -> None:
        target.update(fields)
    return apply


def _drop(key: str) -> DocEdit:
    def apply(rng: random.Random, target: dict[str, Any]) -> None:
        target.pop(key, None)
    return apply


def _with_parts(kind: str) -> DocEdit:
    def apply(rng: random.Random, message: dict[str, Any]) -> None:
        message["content"] = _parts(kind, _text(rng))
    return apply


def _replaced(value: Any) -> MessageEdit:
    """The message itself replaced by ``value`` (not an object)."""
    return lambda rng, message: value


def _reasoning_content(rng: random.Random, message: dict[str, Any]) -> None:
    message.update(role="assistant", reasoning_content=_text(rng))
ROLES: Final[tuple[Any, ...]] = ("user", "assistant", "system", "tool", "developer", "function", "SYSTEM", "",
                                 "r" * 10_000, 5, None, ["user"], {"role": "user"})


def _message_edits() -> list[tuple[str, MessageEdit]]:
    """(label, edit) for one message: its role, content, name, tool fields and reasoning, or the message itself."""
    edits: list[tuple[str, MessageEdit]] = []

    for role in ROLES:
        edits.append((f"role={role!r:.20}", _set(role=role)))
    edits.append(("no role", _drop("role")))
    for i, text in enumerate(TEXTS + LONG_TEXTS):
        edits.append((f"content=TEXTS[{i}]", _set(content=text)))
    for kind in PART_KINDS:
        edits.append((f"content parts {kind}", _with_parts(kind)))
    for i, value in enumerate(ODD):
        edits.append((f"content=ODD[{i}]", _set(content=value)))
        edits.append((f"text part text=ODD[{i}]", _set(content=_odd_text_part(value))))
        edits.append((f"name=ODD[{i}]", _set(name=value)))
        edits.append((f"tool message tool_call_id=ODD[{i}]", _set(role="tool", tool_call_id=value)))
        edits.append((f"reasoning=ODD[{i}]", _set(role="assistant", reasoning=value)))
        edits.append((f"developer tools=ODD[{i}]", _set(role="developer", tools=value)))
    for i, calls in enumerate(TOOL_CALLS):
        edits.append((f"tool_calls=TOOL_CALLS[{i}]", _set(role="assistant", tool_calls=calls)))
    edits.append(("reasoning_content", _reasoning_content))
    for i, value in enumerate(("hi", None, 5, [], ["user", "hi"], [[["x"]]])):
        edits.append((f"message=ODD_MESSAGE[{i}]", _replaced(value)))
    return edits


MESSAGE_EDITS: Final = _message_edits()


# --- the request -------------------------------------------------------------------------------


def _final_message_edits() -> list[tuple[str, DocEdit]]:
    """continue_final_message with each kind of final message (transformers cuts the text after it)."""
    finals: tuple[Any, ...] = ("partial answer ", "", "  spaced  ", None, 5, [{"type": "text", "text": "part"}],
                               [{"type": "image_url", "image_url": {}}], [], ["plain"], _SPECIAL)

    def edit(final: Any) -> DocEdit:
        def apply(rng: random.Random, doc: Doc) -> None:
            doc["messages"] = [*_messages(doc), {"role": "assistant", "content": final}]
            doc.update(continue_final_message=True, add_generation_prompt=rng.choice((False, None, True)))
        return apply

    return [(f"continue_final_message final={f!r:.30}", edit(f)) for f in finals]


def _messages(doc: Doc) -> list[Any]:
    messages = doc.get("messages")
    return list(messages) if isinstance(messages, list) else []


def _doc_edits() -> list[tuple[str, DocEdit]]:
    """(label, edit) for the request's own fields."""
    edits: list[tuple[str, DocEdit]] = []

    for value in (*ODD, 12345, "x" * 100_000, "\u202e\x00model", *MODELS):
        edits.append((f"model={value!r:.20}", _set(model=value)))
    edits.append(("no model", _drop("model")))
    for value in ({"role": "user", "content": "x"}, "messages", None, [], [[]], 5, [None], [{}]):
        edits.append((f"messages={value!r:.30}", _set(messages=value)))
    edits.append(("no messages", _drop("messages")))
    edits.append(("messages and prompt", _set(prompt="also a prompt")))
    edits.append(("10k messages", _set(messages=[{"role": "user", "content": "m"}] * 10_000)))
    for key in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        for value in (None, "yes", 1, 0, False, True, [], {}):
            edits.append((f"{key}={value!r}", _set(**{key: value})))
    edits += _final_message_edits()
    for value in ("{{ messages }}", None, "", 5, ["x"]):
        edits.append((f"chat_template={value!r}", _set(chat_template=value)))
    for value in ([], "x", 5, {"tokenize": True}, {"chat_template": "x"}, {"self": 1}, {"add_generation_prompt": "x"},
                  {"messages": 1}, {"tools": 1}, {"bos_token": 5}, {"eos_token": None}, {"x": [[["y"]]]},
                  {"enable_thinking": "no"}, {"\x00": 1}, {"documents": [{"x": 1}]}, {"": None}):
        edits.append((f"chat_template_kwargs={value!r:.30}", _set(chat_template_kwargs=value)))
    for value in ([], "docs", 5, [{"title": "t", "text": "x"}], [None], [{"text": {"a": 1}}]):
        edits.append((f"documents={value!r:.30}", _set(documents=value)))
    for value in ("none", "high", "auto", 5, [], None, ""):
        edits.append((f"reasoning_effort={value!r}", _set(reasoning_effort=value)))
    for value in (5, 0, None, -1, "x"):
        edits.append((f"truncate_prompt_tokens={value!r}", _set(truncate_prompt_tokens=value)))
    for value in (*ODD, "s" * 100_000, "\u202e\x00"):
        edits.append((f"cache_salt={value!r:.20}", _set(cache_salt=value)))
    for i, tools in enumerate(TOOLS):
        edits.append((f"tools=TOOLS[{i}]", _set(tools=tools)))
    edits.append(("tool_choice", _set(tool_choice={"type": "function", "function": {"name": 5}})))
    return edits


DOC_EDITS: Final = _doc_edits()


def chat_base(rng: random.Random) -> Doc:
    """A small chat request (a shared system prompt half the time, so the warm events match it)."""
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.5 else random_text(rng, rng.randint(0, 60))
    messages: list[Any] = [{"role": "system", "content": system}]
    messages += [{"role": rng.choice(("user", "assistant")), "content": _text(rng)} for _ in range(rng.randint(0, 3))]
    return {"model": rng.choice(MODELS), "messages": messages}


def edit_message(rng: random.Random, doc: Doc, label_edit: tuple[str, MessageEdit]) -> str:
    """Apply a message edit to one of the request's messages (a new one appended a third of the time)."""
    label, edit = label_edit
    messages = _messages(doc)
    at = len(messages) if not messages or rng.random() < 1 / 3 else rng.randrange(len(messages))
    if at == len(messages):
        messages.append({"role": "user", "content": "new"})
    message = messages[at] if isinstance(messages[at], dict) else {"role": "user"}
    message = dict(message)
    replaced = edit(rng, message)
    messages[at] = message if replaced is None else replaced
    doc["messages"] = messages
    return f"message {at}: {label}"


# --- completions ---------------------------------------------------------------------------------
PROMPTS: Final[tuple[Any, ...]] = (
    *TEXTS, *LONG_TEXTS, [], [0], [1, 2, 3], [4294967295], [4294967296], [-1], [18446744073709551615], [True, False],
    [1.0, 2.0], [1, "a"], ["a"], ["a", "b"], [["a"]], [[1, 2]], [[]], [[1, 2], [3]], [[[1]]], [None], {"a": 1}, None,
    5, 1.5, True, list(range(50_000)), [list(range(10))], "p" * 262_144,
)


def completions_base(rng: random.Random) -> Doc:
    return {"model": rng.choice(MODELS), "prompt": _text(rng)}


def _completions_edits() -> list[tuple[str, DocEdit]]:
    edits: list[tuple[str, DocEdit]] = []
    for i, prompt in enumerate(PROMPTS):
        edits.append((f"prompt=PROMPTS[{i}]", _set(prompt=prompt)))
    edits.append(("no prompt, inputs", _moved_prompt("inputs")))
    edits.append(("no prompt, input", _moved_prompt("input", instructions="x")))
    for key, values in (("prompt_embeds", ("AAAA", None, [])), ("add_special_tokens", (False, "x", None, 0)),
                        ("truncate_prompt_tokens", (3, None)), ("model", ODD), ("cache_salt", (5, "s", None))):
        for value in values:
            edits.append((f"{key}={value!r:.20}", _set(**{key: value})))
    return edits


def _moved_prompt(to: str, **extra: Any) -> DocEdit:
    """The prompt under another field (TGI's inputs, the Responses API's input): not a completions body."""
    def apply(rng: random.Random, doc: Doc) -> None:
        doc.update({to: doc.pop("prompt", None)}, **extra)
    return apply


COMPLETIONS_EDITS: Final = _completions_edits()


# --- deep nesting at every place the precise path reads -------------------------------------------
def _at_message(key: str, wrap: Callable[[Raw], Any] = lambda r: r, role: str = "user") -> Callable[[Doc, Raw], None]:
    def put(doc: Doc, raw: Raw) -> None:
        doc["messages"] = [*_messages(doc), {"role": role, "content": "c", key: wrap(raw)}]
    return put


def _at_doc(key: str, wrap: Callable[[Raw], Any] = lambda r: r) -> Callable[[Doc, Raw], None]:
    return lambda doc, raw: doc.update({key: wrap(raw)})


DEEP_PLACES: Final[tuple[tuple[str, Callable[[Doc, Raw], None]], ...]] = (
    ("model", _at_doc("model")),
    ("messages", _at_doc("messages")),
    ("messages[0]", _at_doc("messages", lambda r: [r])),
    ("content", _at_message("content")),
    ("content part", _at_message("content", lambda r: [r])),
    ("text part text", _at_message("content", lambda r: [{"type": "text", "text": r}])),
    ("text part extra key", _at_message("content", lambda r: [{"type": "text", "text": "t", "x": r}])),
    ("name", _at_message("name")),
    ("role", _at_message("role")),
    ("tool_call_id", _at_message("tool_call_id", role="tool")),
    ("reasoning", _at_message("reasoning", role="assistant")),
    ("developer tools", _at_message("tools", role="developer")),
    ("tool_calls", _at_message("tool_calls", role="assistant")),
    ("tool call arguments", _at_message("tool_calls", lambda r: [_tool_call(r)], role="assistant")),
    ("tool call id", _at_message("tool_calls", lambda r: [{**_tool_call("{}"), "id": r}], role="assistant")),
    ("tools", _at_doc("tools")),
    ("tool parameters", _at_doc("tools", lambda r: [{"type": "function", "function": {"name": "f", "parameters": r}}])),
    ("tool extra key", _at_doc("tools", lambda r: [{"type": "function", "function": {"name": "f"}, "x": r}])),
    ("chat_template_kwargs value", _at_doc("chat_template_kwargs", lambda r: {"x": r})),
    ("documents", _at_doc("documents")),
    ("reasoning_effort", _at_doc("reasoning_effort")),
    ("cache_salt", _at_doc("cache_salt")),
    ("add_generation_prompt", _at_doc("add_generation_prompt")),
    ("prompt", _at_doc("prompt")),
    ("unknown field", _at_doc("zzz")),
)


def _deep_string(text: str) -> Callable[[Doc], None]:
    """A deeply nested JSON text as a tool call's arguments string (vLLM parses it: json.loads)."""
    def put(doc: Doc) -> None:
        doc["messages"] = [*_messages(doc), {"role": "assistant", "content": "", "tool_calls": [_tool_call(text)]}]
    return put


def _deep_cases() -> list[tuple[str, Callable[[Doc], None]]]:
    """The deep JSON texts in a string, then every place at each depth (Python's recursion limit's
    first) in each nesting kind: a short run meets every place at the depth that breaks recursion."""
    cases: list[tuple[str, Callable[[Doc], None]]] = [
        (f"tool call arguments string: {text[:12]}... ({len(text)} chars)", _deep_string(text))
        for text in DEEP_STRINGS]
    for depth in sorted(DEPTHS, key=lambda d: d != 1000):
        for kind in (0, 1):
            for place, put in DEEP_PLACES:
                cases.append((f"{place}: {depth} deep {'arrays' if kind == 0 else 'objects'}",
                              _placed(put, deep(depth, kind))))
    return cases


def _placed(put: Callable[[Doc, Raw], None], raw: Raw) -> Callable[[Doc], None]:
    return lambda doc: put(doc, raw)


DEEP_CASES: Final = _deep_cases()


# --- dumping with raw values ----------------------------------------------------------------------
def _marked(value: Any, raws: list[bytes]) -> Any:
    """``value`` with every Raw replaced by a marker string naming its index in ``raws``."""
    if isinstance(value, Raw):
        raws.append(value.data)
        return f"@@raw-{len(raws) - 1}@@"
    if isinstance(value, dict):
        return {k: _marked(v, raws) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v, raws) for v in value]
    return value


def dump_raw(rng: random.Random, doc: Any) -> bytes:
    """JSON with random escaping (lone surrogates as CESU-8 bytes or escapes), Raw values spliced in."""
    raws: list[bytes] = []
    text = json.dumps(_marked(doc, raws), ensure_ascii=rng.random() < 0.5,
                      separators=rng.choice((None, (",", ":"))))
    body = text.encode("utf-8", "surrogatepass")
    for i, raw in enumerate(raws):
        body = body.replace(b'"@@raw-%d@@"' % i, raw)
    return body

