"""``--tokenizer DIR``: a model's real tokenizer and chat template instead of the stand-in.

Prompts are rendered and tokenised by the router's own
:class:`extproc.pick.tokens.prompt_tokens.ModelTokenizer` (exactly what vLLM computes for that
model; its chat texts always rendered by Jinja, never spliced, so the router's splicing is checked
against Jinja's text), so a replica's cache, ``usage.prompt_tokens``, ``cached_tokens`` and
KV-cache events all follow from the token ids a real vLLM replica would compute. A request it cannot tokenise
(:class:`NotTokenizable`) is answered with a 400, as vLLM answers a request its renderer refuses.

Generated tokens cycle through the ids of the stand-in's filler text encoded once with this
tokenizer (so every output id is a valid id of the model's vocabulary); their text is the
tokenizer's decoding of that cycle, cut per token.

One instance serves every replica of a fleet (they share one event loop; ModelTokenizer is not
thread-safe).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable, TokenizerError
from routerlab.sim import tokenizer as standin
from routerlab.sim.api import ApiError

__all__ = ["HfTokenizer", "TokenizerError"]


class HfTokenizer:
    """Prompt token ids and output tokens of one model directory (Hugging Face layout)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        # raises TokenizerError on a bad directory; rendered by Jinja, as vLLM renders, never spliced:
        # the router's splices are checked against it
        self.model = ModelTokenizer(self.model_dir, splice=False)
        self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = self.model.encode(standin.FILLER_TEXT)
        if not ids:
            raise TokenizerError(f"{self.model_dir}: the filler text encodes to no tokens")
        self.output_ids: tuple[int, ...] = tuple(ids)
        # Text of output token i: the first cycle as decoded from the start, later cycles as decoded
        # after a cycle (prefix-space rules can differ at the start).
        two = list(ids) * 2
        n = len(ids)
        pieces: list[str] = []
        prev = ""
        for k in range(2 * n):
            text = self._tok.decode(two[:k + 1], skip_special_tokens=False)
            pieces.append(text[len(prev):] if text.startswith(prev) else self._tok.decode([two[k]]))
            prev = text
        self._first, self._later = tuple(pieces[:n]), tuple(pieces[n:])

    # ---- prompts -----------------------------------------------------------------------
    def chat(self, body: Mapping[str, Any]) -> list[int]:
        return self._ids(body, "chat")

    def completion(self, body: Mapping[str, Any], prompt: str) -> list[int]:
        """One string prompt of a completions body (``add_special_tokens`` etc. from the body)."""
        return self._ids({**body, "prompt": prompt}, "completions")

    def check_ids(self, ids: list[int]) -> list[int]:
        """vLLM refuses token ids outside the vocabulary."""
        for t in ids:
            if t >= self.vocab_size:
                raise ApiError(f"Token id {t} is out of vocabulary", param="prompt")
        return ids

    def _ids(self, doc: Mapping[str, Any], kind: str) -> list[int]:
        try:
            return self.model.tokens_for(doc, kind)  # type: ignore[arg-type]
        except NotTokenizable as e:
            param = "messages" if kind == "chat" else "prompt"
            raise ApiError(f"Cannot render or tokenise the request ({e})", param=param) from None

    # ---- outputs -----------------------------------------------------------------------
    def output_text(self, count: int, start: int = 0) -> str:
        """The text of generated tokens ``start .. count - 1``."""
        n = len(self.output_ids)
        first, later = self._first, self._later
        return "".join(first[i] if i < n else later[i % n] for i in range(start, count))
