"""What a decision and a pick must satisfy for any request: a broken promise is a fuzz *violation*.

``check`` holds ``decide`` to its promises (plus the fields a case's shape pins);
``choice_problems`` holds the pick path's choice, made on ``pick_core``'s fixed fleet, to its.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Final

import orjson

from extproc.core import isolation
from extproc.core.decide import CONTENT_ENCODING, Decision, decide
from extproc.core.normalize import FALLBACK_REASONS, IDENTITY_ENCODINGS, MODES, TRUNCATED
from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import REASONS, Choice
from extproc.pick.core import PickCore
from extproc.pick.views.chunks import chunk_hashes
from routerlab.fuzz.documents import MODELS, SYSTEM_PROMPTS
from routerlab.fuzz.shapes import Case, Headers, expected_tenant


# --- checks ----------------------------------------------------------------------------
def _encoded(headers: Headers) -> bool:
    return headers.get(CONTENT_ENCODING, "").strip().lower() not in IDENTITY_ENCODINGS


def check(case: Case, settings: RouteSettings, d: Decision) -> list[str]:
    """What ``decide`` promises for any request, plus the fields the case's shape pins."""
    body, problems = case.body, []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    need((d.key is None) == (not body), "key is None iff the body is empty")
    need(d.normalize in MODES and (d.fallback is None or d.fallback in FALLBACK_REASONS), "known mode and fallback")
    need(d.normalized_bytes == len(d.normalized), "normalized_bytes counts the normalised form")
    need(d.prefix_bytes == min(settings.prefix_length, d.normalized_bytes), "prefix_bytes = min(length, form)")
    sent = body if d.body is None else d.body
    need(not body or d.normalize != "raw" or d.normalized == sent, "raw mode hashes the body as sent on")
    need(d.isolation is None if not settings.tenant_isolation else (not body or d.isolation is not None),
         "isolation reports its outcome exactly when it is on")
    if d.body is not None:
        need(isolation.SALT_FIELD.encode() in d.body and len(d.body) > len(body), "a salted body gains the salt")
    if body and _encoded(case.headers):
        need(d.fallback == "content_encoded", "a content-encoded body is keyed raw, never decompressed")
    elif body and not case.complete:
        need(d.normalize == "raw" and d.fallback == (None if settings.normalize == "raw" else TRUNCATED),
             "a partial body is keyed raw")
        need(d.tenant_source != "body", "a partial body is not parsed for its tenant")
    need(not d.tenant_rejected or (d.tenant is None and d.tenant_source is None), "a refused tenant is no tenant")
    need(d.tenant is None or expected_tenant(d.tenant) == (d.tenant, None), "a tenant is short printable ASCII")
    for name, want in case.expect.items():
        need(getattr(d, name) == want, f"{name} == {want!r:.40}")
    return problems


# --- determinism ------------------------------------------------------------------------
def same_json(a: Any, b: Any) -> bool:
    """Two parsed JSON values equal, keys in the same order, types alike (1 is not 1.0 nor True).

    An explicit stack, not ``==``: a parsed body nests up to orjson's 1,024 levels, and ``==`` on
    lists or dicts recurses in C through the interpreter's recursion limit (1,000): a 1,018-deep
    chat content raised RecursionError in the comparison, not in ``decide``.
    """
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if type(x) is dict:
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif type(x) is list:
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y))
        elif x != y:
            return False
    return True


def _dumped(doc: Any) -> bytes | None:
    """The document as orjson writes it (key order and number types kept), or None past its depth
    limit (254 levels) or for a value it cannot write."""
    try:
        return orjson.dumps(doc)
    except (orjson.JSONEncodeError, TypeError):
        return None


def same_document(a: Any, b: Any) -> bool:
    """Two parsed documents equal: by their serialisation (C speed, no recursion limit to meet), and
    only when either cannot be written, by ``same_json``'s walk (such bodies are small: a deep one)."""
    if a is b:
        return True
    dumped_a, dumped_b = _dumped(a), _dumped(b)
    if dumped_a is not None and dumped_b is not None:
        return dumped_a == dumped_b
    return same_json(a, b)


def differences(a: Decision, b: Decision) -> list[str]:
    """The fields in which two decisions differ: every field by ``==`` but the parsed document,
    compared by ``same_document`` (precise mode renders it, so it routes too)."""
    return [name for name in Decision._fields
            if not (same_document(getattr(a, name), getattr(b, name)) if name == "document"
                    else getattr(a, name) == getattr(b, name))]


# --- the pick path ---------------------------------------------------------------------
CHUNK_BYTES: Final = 512  # the learned view's default chunk
WARM_CHUNKS: Final = 4096  # more than any warm-up prompt has
@functools.cache
def pick_core() -> PickCore:
    """A fixed fleet of 4 (one down, one busy, one with a backlog) and an index warmed by chat prompts.

    With the thresholds ``runner._settings`` draws (1 caps every healthy replica, 4 the busy one)
    the choice takes each of its paths: cold, cheapest, threshold spill and all busy. Only
    ``evaluate`` is called on it, so its state never changes between bodies.
    """
    replicas: list[dict[str, Any]] = [
        {"address": "10.0.0.1:8000", "in_flight": 1},
        {"address": "10.0.0.2:8000", "in_flight": 3, "backlog_tokens": 4000, "token_cost": 1.5},
        {"address": "10.0.0.3:8000", "in_flight": 4, "kv_usage": 0.9, "capacity_tokens": 3000, "request_tokens": 9000},
        {"address": "10.0.0.4:8000", "healthy": False},
    ]
    for r in replicas:
        r["chunks"] = []
    settings = RouteSettings(mode="pick")
    for i, (model, system) in enumerate((m, s) for m in MODELS for s in SYSTEM_PROMPTS):
        body = json.dumps({"model": model, "messages": [{"role": "system", "content": system}]}).encode()
        chunks = chunk_hashes(decide(body, {}, settings).normalized, CHUNK_BYTES, WARM_CHUNKS)
        replicas[i % 3]["chunks"] += [f"{h:016x}" for h in chunks]
    # the saved-state form (``explain --state``'s), so the warm index does not depend on how the core holds it
    return PickCore.from_state({"chunk_bytes": CHUNK_BYTES, "prefill_tokens_per_s": 20000.0, "replicas": replicas})


def choice_problems(choice: Choice) -> list[str]:
    healthy = {r.address for r in pick_core().load.snapshot().replicas if r.healthy}
    ok = choice.reason in REASONS and (choice.address is None or choice.address in healthy)
    return [] if ok else [f"pick chose a known healthy replica (got {choice.address!r}, {choice.reason!r})"]

