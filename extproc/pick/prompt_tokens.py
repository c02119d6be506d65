"""The token ids vLLM computes for an OpenAI-style request, for precise mode (design.md section 9).

:class:`ModelTokenizer` is built from a model directory in the Hugging Face layout
(``tokenizer.json``, ``tokenizer_config.json``, optionally ``chat_template.jinja``) and turns a
request body into exactly the prompt token ids a vLLM replica serving that model computes:

- ``/v1/chat/completions``: the messages are parsed like vLLM's chat parser (content parts joined
  with ``"\\n"`` in the "string" content format, kept as text parts in the "openai" format, which
  vLLM detects from the template as it does), the chat template is rendered like transformers'
  ``apply_chat_template`` (sandboxed jinja2, ``tojson``, ``raise_exception``, ``strftime_now``,
  the special tokens, ``add_generation_prompt``, tools, ``chat_template_kwargs``), the tail cut for
  ``continue_final_message`` as transformers does, and the text tokenised with
  ``add_special_tokens=False`` (vLLM's chat default: the template already holds BOS).
- ``/v1/completions``: a string prompt is tokenised with ``add_special_tokens=True`` (vLLM's
  completions default); a list of token ids is used as is.

The cost is tokenisation, and requests share long prefixes (system prompts, earlier turns), so the
text is tokenised segment by segment with an LRU cache. This is exact, not approximate: Hugging
Face tokenizers split the input on the added tokens first and normalise and pre-tokenise each piece
between them on its own, so a piece's ids depend only on its text and on whether it starts the
input (the prefix-space rules of Metaspace ``prepend_scheme: first`` and ByteLevel). A piece that
does not start the input is tokenised behind an added token (and that token's id dropped), so it
sees exactly the context it has in the full text. Tokenizers whose added tokens match in ways this
split does not reproduce (``lstrip``/``rstrip``/``single_word``, ``normalized`` under a normaliser,
``encode_special_tokens``) get no cache: every text is tokenised whole, and a log line says so.

Pure apart from reading the tokenizer files in the constructor; not thread-safe (one per loop).
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

log = logging.getLogger(__name__)

PathKind = Literal["chat", "completions"]

#: The reasons :class:`NotTokenizable` carries (a closed set: a metrics label).
REASONS: Final = frozenset({
    "no_tokenizer",  # no tokenizer, or no chat template for a chat request
    "template_error",  # the template raised (raise_exception, undefined, type errors)
    "multimodal",  # a non-text content part
    "multiple_prompts",  # /v1/completions with more than one prompt
    "bad_request",  # the body is not what vLLM accepts (vLLM would answer 400)
    "unsupported",  # valid for vLLM, not reproduced here (per-request template, truncation, ...)
    "not_json",  # the body is not a whole JSON object (cut at the buffer limit, or not JSON)
})


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or invalid (a start-up error)."""


class NotTokenizable(Exception):
    """This request's token ids cannot be computed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# -- the chat template environment (transformers' utils/chat_template_utils.py) --------------------

def _compile_template(source: str) -> Any:
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
            return caller()

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
    return env, env.from_string(source)


def _detect_content_format(env: Any, source: str) -> Literal["string", "openai"]:
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


def _token_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TypeError(f"expected a string or a {{'content': ...}} object, got {value!r}")


_TEXT_PART_TYPES: Final = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_MEDIA_KEYS: Final = frozenset({"image_url", "input_image", "image_embeds", "image_pil", "audio_url",
                                "input_audio", "audio_embeds", "video_url", "video_embeds", "prompt_embeds"})


# -- the tokenizer ----------------------------------------------------------------------------------

class ModelTokenizer:
    """A model's tokenizer and chat template, with an exact per-segment token cache.

    ``cache_bytes`` bounds the cache (0 disables it); ``content_format`` is vLLM's
    ``--chat-template-content-format`` ("auto" detects it from the template as vLLM does).
    ``cache_hits``/``cache_misses`` count segments, ``cache_hit_chars``/``cache_miss_chars`` their
    characters; ``cache_bytes_used``/``cache_entries`` the cache's size; ``cache_enabled`` whether
    this tokenizer allows it.
    """

    def __init__(self, model_dir: str | Path, *, cache_bytes: int = 64 << 20,
                 content_format: Literal["auto", "string", "openai"] = "auto") -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        if not d.is_dir():
            raise TokenizerError(f"tokenizer directory {d} does not exist")
        tok_path, cfg_path, jinja_path = d / "tokenizer.json", d / "tokenizer_config.json", d / "chat_template.jinja"
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path} is missing")
        if not cfg_path.is_file():
            raise TokenizerError(f"{cfg_path} is missing")
        try:
            self._tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # noqa: BLE001 - the Rust errors are of several kinds
            raise TokenizerError(f"{tok_path} is not a valid tokenizer: {e}") from e
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{cfg_path} is not valid JSON: {e}") from e
        self.model_dir = d

        # The special tokens the template sees (transformers' special_tokens_map).
        self.special_tokens: dict[str, Any] = {}
        try:
            for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
                text = _token_text(cfg.get(key))
                if text is not None:
                    self.special_tokens[key] = text
            extra = cfg.get("additional_special_tokens")
            if extra:
                self.special_tokens["additional_special_tokens"] = [_token_text(t) for t in extra]
        except TypeError as e:
            raise TokenizerError(f"{cfg_path}: {e}") from e

        # The chat template: chat_template.jinja wins (newer layout), else tokenizer_config.json's.
        source: str | None
        if jinja_path.is_file():
            source = jinja_path.read_text(encoding="utf-8")
            where = jinja_path
        else:
            source = cfg.get("chat_template")
            where = cfg_path
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
                source = named.get("default")
            if source is not None and not isinstance(source, str):
                raise TokenizerError(f"{cfg_path}: chat_template is neither a string nor a list with a 'default'")
        self.chat_template = source
        self._template: Any = None
        self.content_format: Literal["string", "openai"] = "string"
        if source is not None:
            try:
                env, self._template = _compile_template(source)
            except Exception as e:  # noqa: BLE001 - jinja2 syntax errors
                raise TokenizerError(f"{where}: the chat template does not compile: {e}") from e
            self.content_format = _detect_content_format(env, source) if content_format == "auto" else content_format

        self._setup_split()
        self._setup_post_processor()

        self.cache_limit = max(0, int(cache_bytes))
        self._cache: OrderedDict[tuple[bool, str], array] = OrderedDict()
        self.cache_bytes_used = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_hit_chars = 0
        self.cache_miss_chars = 0

    # -- set-up ---------------------------------------------------------------------------------

    def _setup_split(self) -> None:
        """The added tokens to split on, and whether the split reproduces the tokenizer's."""
        added = self._tok.get_added_tokens_decoder()
        has_normalizer = self._tok.normalizer is not None
        reasons = []
        for t in added.values():
            if t.lstrip or t.rstrip or t.single_word:
                reasons.append(f"{t.content!r} has lstrip/rstrip/single_word")
            if t.normalized and has_normalizer:
                reasons.append(f"{t.content!r} is matched after normalisation")
        if getattr(self._tok, "encode_special_tokens", False):
            reasons.append("encode_special_tokens is on")
        contents = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        self._split_re = re.compile("|".join(re.escape(c) for c in contents)) if contents else None
        # A separator for pieces that do not start the text: an added token that encodes to one id.
        self._sep: str | None = None
        self._sep_id = -1
        for c in contents[::-1]:
            ids = self._tok.encode(c, add_special_tokens=False).ids
            if len(ids) == 1:
                self._sep, self._sep_id = c, ids[0]
                break
        if not contents:
            reasons.append("there are no added tokens to split on")
        elif self._sep is None:
            reasons.append("no added token encodes to a single id")
        self.cache_enabled = not reasons
        self.cache_disabled_reason = "; ".join(reasons)
        if reasons:
            log.warning("prompt token cache disabled for %s: %s", self.model_dir, self.cache_disabled_reason)

    def _setup_post_processor(self) -> None:
        """What ``add_special_tokens=True`` adds around a single text, if it is a fixed prefix and
        suffix (it is for BOS/EOS templates); else None (then such texts are tokenised whole)."""
        self._special_affix: tuple[list[int], list[int]] | None = None
        probe = "probe text 12"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                prefix, suffix = full[:i], full[i + len(bare):]
                other = self._tok.encode("other", add_special_tokens=True).ids
                other_bare = self._tok.encode("other", add_special_tokens=False).ids
                if other == prefix + other_bare + suffix:
                    self._special_affix = (prefix, suffix)
                return

    # -- tokenisation -----------------------------------------------------------------------------

    def encode_uncached(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The reference: the tokenizer on the whole text."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...).ids``, served from the segment cache."""
        return self.encode_array(text, add_special_tokens=add_special_tokens).tolist()

    def encode_array(self, text: str, *, add_special_tokens: bool = False) -> array:
        """``encode`` as an ``array('I')``: cached segments join by memory copy, and precise mode
        hashes the ids' bytes, so a 17,000-token prompt never becomes a list of int objects."""
        if add_special_tokens:
            if self._special_affix is None:
                return array("I", self.encode_uncached(text, add_special_tokens=True))
            prefix, suffix = self._special_affix
            return array("I", prefix) + self.encode_array(text) + array("I", suffix)
        if not self.cache_enabled or self.cache_limit == 0 or self._split_re is None:
            return array("I", self.encode_uncached(text))
        out: list[array | int] = []
        pos = 0
        pending: list[tuple[int, bool, str]] = []  # (index in out, first, text) still to tokenise
        parts: list[Any] = []
        for m in self._split_re.finditer(text):
            if m.start() > pos:
                parts.append((pos == 0, text[pos:m.start()]))
            parts.append(m.group())
            pos = m.end()
        if pos < len(text):
            parts.append((pos == 0, text[pos:]))
        added_ids = self._added_ids
        cache = self._cache
        for part in parts:
            if isinstance(part, str):
                out.append(added_ids[part])
                continue
            key = part
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
                self.cache_hits += 1
                self.cache_hit_chars += len(key[1])
                out.append(hit)
            else:
                pending.append((len(out), key[0], key[1]))
                out.append(-1)  # placeholder, replaced below
        if not pending:
            return _joined(out)
        inputs = [seg if first else self._sep + seg for _, first, seg in pending]
        encoded = self._tok.encode_batch_fast(inputs, add_special_tokens=False) if len(inputs) > 1 else \
            [self._tok.encode(inputs[0], add_special_tokens=False)]
        for (at, first, seg), enc in zip(pending, encoded, strict=True):
            ids = enc.ids
            if not first:
                if not ids or ids[0] != self._sep_id:  # cannot happen with a split-before tokenizer
                    return array("I", self.encode_uncached(text))
                ids = ids[1:]
            self.cache_misses += 1
            self.cache_miss_chars += len(seg)
            out[at] = self._store((first, seg), ids)
        return _joined(out)

    @property
    def _added_ids(self) -> dict[str, int]:
        ids = getattr(self, "_added_ids_map", None)
        if ids is None:
            ids = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
            self._added_ids_map = ids
        return ids

    def _store(self, key: tuple[bool, str], ids: list[int]) -> array:
        value = array("I", ids)
        cost = self._cost(key, value)
        if cost > self.cache_limit:
            return value
        old = self._cache.pop(key, None)
        if old is not None:
            self.cache_bytes_used -= self._cost(key, old)
        self._cache[key] = value
        self.cache_bytes_used += cost
        while self.cache_bytes_used > self.cache_limit:
            k, v = self._cache.popitem(last=False)
            self.cache_bytes_used -= self._cost(k, v)
        return value

    @staticmethod
    def _cost(key: tuple[bool, str], value: array) -> int:
        # The text (up to 4 bytes a character in CPython), the ids, and the entries' overhead.
        return len(key[1]) * (1 if key[1].isascii() else 4) + 4 * len(value) + 200

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
        self.cache_bytes_used = 0

    # -- requests ---------------------------------------------------------------------------------

    def tokens_for(self, doc: Mapping[str, Any], path_kind: PathKind) -> list[int]:
        """The prompt token ids vLLM computes for the request body ``doc`` on ``path_kind``
        ("chat": /v1/chat/completions, "completions": /v1/completions); raises
        :class:`NotTokenizable` when it cannot say."""
        return self.token_array(doc, path_kind).tolist()

    def token_array(self, doc: Mapping[str, Any], path_kind: PathKind) -> array:
        """``tokens_for`` as an ``array('I')`` (what precise mode hashes)."""
        if not isinstance(doc, Mapping):
            raise NotTokenizable("bad_request", "the body is not a JSON object")
        if doc.get("truncate_prompt_tokens") is not None:
            raise NotTokenizable("unsupported", "truncate_prompt_tokens")
        if path_kind == "chat":
            text = self.render_chat(doc)
            return self.encode_array(text, add_special_tokens=_bool(doc, "add_special_tokens", False))
        if path_kind == "completions":
            return self._completion_tokens(doc)
        raise NotTokenizable("bad_request", f"unknown path kind {path_kind!r}")

    def _completion_tokens(self, doc: Mapping[str, Any]) -> array:
        if doc.get("prompt_embeds") is not None:
            raise NotTokenizable("unsupported", "prompt_embeds")
        prompt = doc.get("prompt")
        add_special = _bool(doc, "add_special_tokens", True)
        if isinstance(prompt, list):
            if not prompt:
                raise NotTokenizable("bad_request", "empty prompt list")
            if all(_is_token_id(t) for t in prompt):
                return _ids(prompt)
            if len(prompt) > 1:
                raise NotTokenizable("multiple_prompts", f"{len(prompt)} prompts")
            prompt = prompt[0]
            if isinstance(prompt, list):
                if prompt and all(_is_token_id(t) for t in prompt):
                    return _ids(prompt)
                raise NotTokenizable("bad_request", "a prompt list that is not token ids")
        if isinstance(prompt, str):
            return self.encode_array(prompt, add_special_tokens=add_special)
        raise NotTokenizable("bad_request", "prompt is neither a string nor token ids")

    def render_chat(self, doc: Mapping[str, Any]) -> str:
        """The chat template rendered for a chat completions body, as vLLM renders it."""
        if self._template is None:
            raise NotTokenizable("no_tokenizer", "the model has no chat template")
        if doc.get("chat_template") is not None:
            raise NotTokenizable("unsupported", "a per-request chat_template")
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise NotTokenizable("bad_request", "messages is not a non-empty list")
        add_generation_prompt = _bool(doc, "add_generation_prompt", True)
        continue_final = _bool(doc, "continue_final_message", False)
        if add_generation_prompt and continue_final:
            # vLLM's request validator: "Cannot set both `continue_final_message` and
            # `add_generation_prompt` to True."
            raise NotTokenizable("bad_request", "continue_final_message with add_generation_prompt")
        conversation = [self._parse_message(m) for m in messages]
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
        variables: dict[str, Any] = {**self.special_tokens, **merged}
        # transformers handles continue_final_message after rendering; the template does not see it.
        variables.pop("continue_final_message", None)
        variables.pop("return_assistant_tokens_mask", None)
        for key in ("messages", "tools", "documents"):
            variables.pop(key, None)
        try:
            text = self._template.render(messages=conversation, tools=tools, documents=merged.get("documents"),
                                         **variables)
        except Exception as e:  # noqa: BLE001 - TemplateError, UndefinedError, TypeError, ...
            raise NotTokenizable("template_error", f"{type(e).__name__}: {e}") from e
        if continue_final:
            text = _cut_after_final_message(text, conversation[-1])
        return text

    def _parse_message(self, message: Any) -> dict[str, Any]:
        """One message as vLLM's chat parser hands it to the template."""
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise NotTokenizable("bad_request", "a message without a role")
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = content
        else:
            raise NotTokenizable("bad_request", "content is neither a string nor a list of parts")
        texts: list[Any] = []
        for part in parts:
            if isinstance(part, str):
                texts.append(part if self.content_format == "string" else {"type": "text", "text": part})
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
                if self.content_format == "string":
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
        if self.content_format == "string":
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


def _joined(parts: list[array | int]) -> array:
    """The pieces of a text's ids, in order: cached arrays and single added-token ids."""
    out = array("I")
    for part in parts:
        if isinstance(part, int):
            out.append(part)
        else:
            out.extend(part)
    return out


def _ids(prompt: list[Any]) -> array:
    try:
        return array("I", prompt)
    except OverflowError:
        raise NotTokenizable("bad_request", "a token id outside 0..2**32-1") from None


def _bool(doc: Mapping[str, Any], key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise NotTokenizable("bad_request", f"{key} is not a boolean")
    return value


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


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
        dumped_fn.update({k: v for k, v in fn.items() if k not in dumped_fn and not (k == "defer_loading" and v is None)})
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
                except ValueError:
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

