"""Catch, at run time, a tokenizer that does not match the replicas' own.

Precise mode matches a request's token ids against what the replicas report they hold, so a
``--tokenizer`` that is not the replica's model (another revision, another chat template) would
quietly match nothing, or the wrong blocks. This gatherer takes a sample of the requests precise
mode routed (the first of each model, then one in ``every``), asks the chosen replica's vLLM
``POST /tokenize`` for the same body off the request path, and compares the token ids.

A model whose last check disagreed is distrusted: its requests go to the learned view (counted
as ``tokenizer_mismatch``) until a later check agrees again; sampling goes on while it is
distrusted, so a fixed replica is trusted again without a restart. Why the last check alone:
tokenisation is deterministic, so one disagreement is proof, and one agreement after it means
the replica (or its rollout) changed. A check that fails (timeout, no ``/tokenize``, an error
status) says nothing about the tokenizer: it is counted and changes no trust.

Only bodies ``/tokenize`` can express are sampled: chat messages (with tools, the generation
prompt flags, ``chat_template_kwargs``, ``add_special_tokens``) and string completions prompts;
token-id prompts need no tokenizer, and fields ``/tokenize`` lacks (``documents``,
``reasoning_effort``) would make the replica's answer differ from what it computes for the
request itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from extproc.core.decide import Decision
from extproc.pick.tokens.prompt_tokens import NotTokenizable
from extproc.pick.views.precise import PreciseView

log = logging.getLogger("extproc.pick.sources.tokenizer_check")

RESULTS: Final = ("match", "mismatch", "error")
CHAT_FIELDS: Final = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                      "chat_template_kwargs", "add_special_tokens")
COMPLETION_FIELDS: Final = ("prompt", "add_special_tokens")
NOT_EXPRESSIBLE: Final = ("documents", "reasoning_effort", "chat_template")
QUEUE: Final = 8  # samples waiting; more are dropped (counted): the checks must never pile up


@dataclass
class ModelChecks:
    """One model's checks: requests offered, checks by result."""

    results: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    offered: int = 0


def tokenize_body(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The ``POST /tokenize`` body that asks vLLM for this request's prompt token ids, or None
    when ``/tokenize`` cannot express the request (see the module docstring)."""
    if any(doc.get(k) is not None for k in NOT_EXPRESSIBLE):
        return None
    if isinstance(doc.get("messages"), list):
        names: Sequence[str] = CHAT_FIELDS
    elif isinstance(doc.get("prompt"), str):
        names = COMPLETION_FIELDS
    else:
        return None
    body = {k: doc[k] for k in names if doc.get(k) is not None}
    body["model"] = doc.get("model")
    return body


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    """The first position where the two id lists differ (the shorter length if one is a prefix)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return min(len(ours), len(theirs))


class TokenizerCheck:
    """Samples precise mode's requests and checks the router's token ids against the replica's."""

    def __init__(self, precise: PreciseView, every: int, timeout: float = 5.0,
                 ahead: Callable[[Decision], Awaitable[int]] | None = None) -> None:
        self.precise = precise
        self.every = every
        self.timeout = timeout
        # tokenises a sample's long new text on the worker first (TokenizeAhead.prepare with
        # checking=True); returns 0, or non-zero when the worker is too busy: the sample is skipped
        self.ahead = ahead
        self.models: dict[str, ModelChecks] = {}
        self.dropped = 0  # samples dropped because the queue was full
        self.busy = 0  # samples skipped because the worker could not tokenise them ahead
        self._queue: deque[tuple[str, str, dict[str, Any], Decision]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- the request path: O(1), no I/O ----------------------------------------------------
    def offer(self, address: str, decision: Decision) -> None:
        """A request precise mode routed to ``address``: kept if it is this model's sample."""
        doc = decision.document
        if self.every <= 0 or not isinstance(doc, dict):
            return
        model = str(doc.get("model"))
        checks = self.models.setdefault(model, ModelChecks())
        checks.offered += 1
        if (checks.offered - 1) % self.every:
            return
        if len(self._queue) >= QUEUE:
            self.dropped += 1
            return
        self._queue.append((address, model, doc, decision))
        self._wake.set()

    # --- the background task ---------------------------------------------------------------
    async def start(self) -> None:
        if self.every > 0 and self._task is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._task = asyncio.create_task(self._run(), name="tokenizer-check")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                address, model, doc, decision = self._queue.popleft()
                try:
                    await self.check(address, model, doc, decision)
                except Exception:  # never let one sample end the checks
                    log.exception("tokenizer check against %s failed", address)
                    self._count(model, "error")

    async def check(self, address: str, model: str, doc: dict[str, Any], decision: Decision) -> str | None:
        """One check: the router's ids for ``decision`` against the replica's; the result, or
        None when the request is not one ``/tokenize`` can express or the router cannot tokenise."""
        body = tokenize_body(doc)
        if body is None:
            return None
        if self.ahead is not None and await self.ahead(decision):
            self.busy += 1  # its text would be tokenised on the loop: skipped, the next sample is checked
            return None
        try:
            ours = list(self.precise.tokens(decision, checking=True))
        except NotTokenizable:
            return None
        assert self._session is not None
        try:
            async with self._session.post(f"http://{address}/tokenize", json=body) as resp:
                if resp.status != 200:
                    log.warning("tokenizer check: %s answered /tokenize with HTTP %d", address, resp.status)
                    return self._count(model, "error")
                answer = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.warning("tokenizer check: /tokenize on %s failed: %r", address, exc)
            return self._count(model, "error")
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(theirs, list):
            return self._count(model, "error")
        distrusted = self.precise.distrusted
        if theirs == ours:
            if model in distrusted:
                log.warning("tokenizer check: model %r agrees with %s again; precise mode uses its events "
                            "view again", model, address)
                distrusted.discard(model)
            return self._count(model, "match")
        at = first_difference(ours, theirs)
        log.error("tokenizer check: the --tokenizer for model %r disagrees with replica %s: router %d tokens, "
                  "replica %d, first difference at token %d (router %s, replica %s); its requests use the "
                  "learned view until a check agrees", model, address, len(ours), len(theirs), at,
                  ours[at] if at < len(ours) else "end", theirs[at] if at < len(theirs) else "end")
        distrusted.add(model)
        return self._count(model, "mismatch")

    def _count(self, model: str, result: str) -> str:
        self.models.setdefault(model, ModelChecks()).results[result] += 1
        return result
