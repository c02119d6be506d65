"""What a decision and a pick must satisfy for any request: a broken promise is a fuzz *violation*.

``check`` holds ``decide`` to its promises (plus the fields a case's shape pins);
``choice_problems`` holds the pick path's choice, made on ``pick_core``'s fixed fleet, to its.
"""

from __future__ import annotations

import functools
import json

from extproc.core import isolation
from extproc.core.decide import CONTENT_ENCODING, Decision, decide
from extproc.core.normalize import FALLBACK_REASONS, IDENTITY_ENCODINGS, MODES, TRUNCATED
from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import REASONS, Choice
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.core import MAX_REQUEST_CHUNKS, PickCore
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


# --- the pick path ---------------------------------------------------------------------
@functools.cache
def pick_core() -> PickCore:
    """A fixed fleet of 4 (one down, one busy, one with a backlog) and an index warmed by chat prompts.

    With the thresholds ``runner._settings`` draws (1 caps every healthy replica, 4 the busy one)
    the choice takes each of its paths: cold, cheapest, threshold spill and all busy. Only
    ``evaluate`` is called on it, so its state never changes between bodies.
    """
    core = PickCore.from_state({"replicas": [
        {"address": "10.0.0.1:8000", "in_flight": 1},
        {"address": "10.0.0.2:8000", "in_flight": 3, "backlog_tokens": 4000},
        {"address": "10.0.0.3:8000", "in_flight": 4, "kv_usage": 0.9},
        {"address": "10.0.0.4:8000", "healthy": False},
    ]})
    addresses = core.load.addresses()
    settings = RouteSettings(mode="pick")
    for i, (model, system) in enumerate((m, s) for m in MODELS for s in SYSTEM_PROMPTS):
        body = json.dumps({"model": model, "messages": [{"role": "system", "content": system}]}).encode()
        core.index.record(addresses[i % 3], chunk_hashes(decide(body, {}, settings).normalized, core.chunk_bytes,
                                                         MAX_REQUEST_CHUNKS))
    return core


def choice_problems(choice: Choice) -> list[str]:
    healthy = {r.address for r in pick_core().load.snapshot().replicas if r.healthy}
    ok = choice.reason in REASONS and (choice.address is None or choice.address in healthy)
    return [] if ok else [f"pick chose a known healthy replica (got {choice.address!r}, {choice.reason!r})"]

