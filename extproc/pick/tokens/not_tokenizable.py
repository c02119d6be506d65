"""Why a request's token ids cannot be computed: :class:`NotTokenizable` and its :data:`REASONS`.

Its own module because both halves of precise mode's tokenising raise it, chat_render.py (the
chat template) and prompt_tokens.py (the tokenizer, which imports chat_render), and neither can
import the other's; importers take both names from prompt_tokens.py, which re-exports them.
"""

from __future__ import annotations

from typing import Final

#: The reasons :class:`NotTokenizable` carries (a closed set: a metrics label).
REASONS: Final = frozenset({
    "no_tokenizer",  # no tokenizer, or no chat template for a chat request
    "template_error",  # the template raised (raise_exception, undefined, type errors)
    "multimodal",  # a non-text content part
    "multiple_prompts",  # /v1/completions with more than one prompt
    "bad_request",  # the body is not what vLLM accepts (vLLM would answer 400)
    "unsupported",  # valid for vLLM, not reproduced here (per-request template, truncation, ...)
    "tokenizer_mismatch",  # a run-time check found the router's tokenizer disagrees with the replica's
    "not_json",  # the body is not a whole JSON object (cut at the buffer limit, or not JSON)
    "tokenizer_busy",  # long new text not tokenised ahead: the worker's queue was full (tokenize_ahead.py)
})


class NotTokenizable(Exception):
    """This request's token ids cannot be computed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
