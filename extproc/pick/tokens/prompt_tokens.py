"""The token ids vLLM computes for an OpenAI-style request, for precise mode (docs/precise-mode.md,
"How it works": matching a request).

:class:`ModelTokenizer` is built from a model directory in the Hugging Face layout
(``tokenizer.json``, ``tokenizer_config.json``, optionally ``chat_template.jinja``) and turns a
request body into exactly the prompt token ids a vLLM replica serving that model computes:

- ``/v1/chat/completions``: the chat template rendered as vLLM renders it (chat_render.py: vLLM's
  message parsing and content format, transformers' ``apply_chat_template``,
  ``continue_final_message``), and the text tokenised with ``add_special_tokens=False`` (vLLM's
  chat default: the template already holds BOS).
- ``/v1/completions``: a string prompt is tokenised with ``add_special_tokens=True`` (vLLM's
  completions default); a list of token ids is used as is.

This module is the model directory and the request-level API. The template rendering lives in
chat_render.py because it is a separate idea with its own reference (vLLM's and transformers'
chat code), and a text's ids, exact through the segment cache and the prompt memo, in
segment_cache.py (``SegmentTokenizer``, which ``ModelTokenizer`` is).

Pure apart from reading the tokenizer files in the constructor; not thread-safe (one per loop),
except ``encode_segments``, which a worker thread runs (extproc.pick.sources.tokenize_ahead).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from extproc.pick.tokens.chat_render import (
    compile_template,
    detect_content_format,
    render_chat,
    request_bool,
    token_text,
)
from extproc.pick.tokens.chat_splice import ChatSplice
from extproc.pick.tokens.id_run import IdRun

# Defined in not_tokenizable.py (chat_render.py raises NotTokenizable too); importers take them from here.
from extproc.pick.tokens.not_tokenizable import REASONS, NotTokenizable
from extproc.pick.tokens.segment_cache import SegmentTokenizer

__all__ = ["REASONS", "ModelTokenizer", "NotTokenizable", "PathKind", "TokenizerError"]

PathKind = Literal["chat", "completions"]


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or invalid (a start-up error)."""


# -- the tokenizer ----------------------------------------------------------------------------------

class ModelTokenizer(SegmentTokenizer):
    """A model's tokenizer and chat template, with an exact per-segment token cache (``SegmentTokenizer``:
    ``encode``/``encode_run`` and the cache's counters).

    ``cache_bytes`` bounds the segment cache and, as much again, the prompt memo (0 disables both);
    ``content_format`` is vLLM's ``--chat-template-content-format`` ("auto" detects it from the
    template as vLLM does); ``splice``: chat texts spliced where the template only copies contents
    (extproc.pick.tokens.chat_splice; False: always rendered by Jinja, as the simulator renders them).
    """

    def __init__(self, model_dir: str | Path, *, cache_bytes: int = 64 << 20,
                 content_format: Literal["auto", "string", "openai"] = "auto", splice: bool = True) -> None:
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
            tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # noqa: BLE001 - the Rust errors are of several kinds
            raise TokenizerError(f"{tok_path} is not a valid tokenizer: {e}") from e
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{cfg_path} is not valid JSON: {e}") from e

        # The special tokens the template sees (transformers' special_tokens_map).
        self.special_tokens: dict[str, Any] = {}
        try:
            for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
                text = token_text(cfg.get(key))
                if text is not None:
                    self.special_tokens[key] = text
            extra = cfg.get("additional_special_tokens")
            if extra:
                self.special_tokens["additional_special_tokens"] = [token_text(t) for t in extra]
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
        self.splice: ChatSplice | None = None  # renders by splicing where the template only copies contents
        self.jinja_renders = 0  # chat texts rendered by Jinja (not spliced)
        self.content_format: Literal["string", "openai"] = "string"
        if source is not None:
            try:
                env, self._template = compile_template(source)
            except Exception as e:  # noqa: BLE001 - jinja2 syntax errors
                raise TokenizerError(f"{where}: the chat template does not compile: {e}") from e
            self.content_format = detect_content_format(env, source) if content_format == "auto" else content_format
            if splice:
                self.splice = ChatSplice(env, source, self._template, self._render_with)

        super().__init__(tok, d, cache_bytes)  # the segment cache, set up for this tokenizer
        self._rendered: tuple[Mapping[str, Any], str] | None = None  # request_missing's doc and its text

    # -- requests ---------------------------------------------------------------------------------

    def tokens_for(self, doc: Mapping[str, Any], path_kind: PathKind) -> list[int]:
        """The prompt token ids vLLM computes for the request body ``doc`` on ``path_kind``
        ("chat": /v1/chat/completions, "completions": /v1/completions); raises
        :class:`NotTokenizable` when it cannot say."""
        return self.token_array(doc, path_kind).tolist()

    def token_array(self, doc: Mapping[str, Any], path_kind: PathKind) -> array[int]:
        """``tokens_for`` as one ``array('I')`` (the memo's own when the ids are all of it: read it only)."""
        return self.token_run(doc, path_kind).array()

    def token_run(self, doc: Mapping[str, Any], path_kind: PathKind, max_new_chars: int = 0) -> IdRun:
        """``tokens_for`` as an :class:`IdRun` (what precise mode hashes); ``max_new_chars``: as
        ``encode_run``'s."""
        self.resumed = None
        prompt = self._prompt(doc, path_kind)
        if isinstance(prompt, array):
            return IdRun(prompt)
        add_special = request_bool(doc, "add_special_tokens", path_kind == "completions")  # vLLM's defaults
        return self.encode_run(prompt, add_special_tokens=add_special, max_new_chars=max_new_chars)

    def request_missing(self, doc: Mapping[str, Any], path_kind: PathKind) -> list[tuple[bool, str]]:
        """``missing`` of the text ``token_run`` would tokenise for ``doc`` (none for token ids);
        raises NotTokenizable as it does. The rendered chat text is kept for the next ``token_run``
        of the same ``doc`` (precise mode asks this, then picks: one render, not two)."""
        prompt = self._prompt(doc, path_kind)
        if isinstance(prompt, array):
            return []
        if path_kind == "chat":
            self._rendered = (doc, prompt)
        return self.missing(prompt)

    def render_chat(self, doc: Mapping[str, Any]) -> str:
        """The chat template rendered for a chat completions body, as vLLM renders it (spliced where
        extproc.pick.tokens.chat_splice proved the same text)."""
        if self.splice is not None:
            text = self.splice.render(doc)
            if text is not None:
                return text
        self.jinja_renders += 1
        return self._render_with(self._template, doc)

    def _render_with(self, template: Any, doc: Mapping[str, Any]) -> str:
        return render_chat(template, self.special_tokens, self.content_format, doc)

    def _prompt(self, doc: Mapping[str, Any], path_kind: PathKind) -> str | array[int]:
        """What the request's ids come from: the text to tokenise (the rendered chat template, or a
        completions string) or the ids themselves; raises NotTokenizable."""
        if not isinstance(doc, Mapping):
            raise NotTokenizable("bad_request", "the body is not a JSON object")
        if doc.get("truncate_prompt_tokens") is not None:
            raise NotTokenizable("unsupported", "truncate_prompt_tokens")
        if path_kind == "chat":
            rendered, self._rendered = self._rendered, None
            return rendered[1] if rendered is not None and rendered[0] is doc else self.render_chat(doc)
        if path_kind == "completions":
            return _completion_prompt(doc)
        raise NotTokenizable("bad_request", f"unknown path kind {path_kind!r}")


def _completion_prompt(doc: Mapping[str, Any]) -> str | array[int]:
    """A /v1/completions body's one prompt: a string, or token ids; raises NotTokenizable."""
    if doc.get("prompt_embeds") is not None:
        raise NotTokenizable("unsupported", "prompt_embeds")
    prompt = doc.get("prompt")
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
        return prompt
    raise NotTokenizable("bad_request", "prompt is neither a string nor token ids")


def _ids(prompt: list[Any]) -> array[int]:
    try:
        return array("I", prompt)
    except OverflowError:
        raise NotTokenizable("bad_request", "a token id outside 0..2**32-1") from None


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
