"""Envoy's JSON access log, one request a line, read leniently.

Keys (the A/B configs' ``json_format``): ``start_time`` (%START_TIME%), ``arm``, ``session``,
``tenant``, ``upstream_host``, ``upstream_cluster``, ``status``, ``ttft_ms``
(%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:ms)%), ``duration_ms``, ``path`` and optionally
``response_flags``. Envoy writes "-" for a value it does not have; such values read as absent.
A line that is not a JSON object, or has no usable ``start_time`` or ``arm``, is garbage: it is
counted and a few are kept for the report, never guessed at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ARMS = ("prefix", "stock")
# Envoy's response flags for a request the upstream never answered whole: reset, connection
# failure, overflow, no healthy host, upstream timeout, retry limit hit on resets.
RESET_FLAGS = {"UR", "UC", "UF", "UO", "UH", "UT", "URX", "NR"}


@dataclass(frozen=True, slots=True)
class Request:
    t: float  # start, seconds since the epoch (UTC)
    arm: str
    session: str | None
    tenant: str | None
    host: str | None
    status: int | None  # None: Envoy had no response code ("-"), 0: no response at all
    ttft_ms: float | None
    duration_ms: float | None
    flags: frozenset[str] = frozenset()

    @property
    def error(self) -> bool:
        """A 5xx, or an upstream reset / connection failure (status 0, or a reset flag)."""
        return (self.status is not None and (self.status >= 500 or self.status == 0)) or bool(self.flags & RESET_FLAGS)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300 and not self.error


@dataclass
class Log:
    requests: list[Request] = field(default_factory=list)
    lines: int = 0
    garbage: int = 0
    garbage_examples: list[str] = field(default_factory=list)  # at most 5, each cut to 120 characters
    unknown_arm: int = 0  # parsed lines whose arm is "-" or unknown (not an A/B route)


def _absent(value: object) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in ("", "-"))


def _text(value: object) -> str | None:
    return None if _absent(value) else str(value)


def _number(value: object) -> float | None:
    if _absent(value) or isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if number == number and number >= 0 else None  # NaN and negatives are not durations


def parse_time(value: object) -> float | None:
    """%START_TIME% ("2026-12-01T22:10:00.123Z") or epoch seconds -> epoch seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str) or _absent(value):
        return None
    try:
        return datetime.fromisoformat(value.strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_line(line: str) -> Request | str | None:
    """A request; a str saying why the line is garbage; None for a blank line."""
    line = line.strip()
    if not line:
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict):
        return "not a JSON object"
    t = parse_time(doc.get("start_time"))
    if t is None:
        return "no start_time"
    status = _number(doc.get("status"))
    flags = _text(doc.get("response_flags"))
    return Request(
        t=t, arm=(_text(doc.get("arm")) or "-").lower(), session=_text(doc.get("session")),
        tenant=_text(doc.get("tenant")), host=_text(doc.get("upstream_host")),
        status=None if status is None else int(status), ttft_ms=_number(doc.get("ttft_ms")),
        duration_ms=_number(doc.get("duration_ms")),
        flags=frozenset(flags.split(",")) if flags else frozenset(),
    )


def read(path: str | Path, max_lines: int = 50_000_000) -> Log:
    """Every request of the log with a known arm; garbage and arm-less lines counted."""
    log = Log()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            log.lines += 1
            if log.lines > max_lines:
                raise ValueError(f"{path}: more than {max_lines} lines; cut the log to the experiment's time span")
            parsed = parse_line(line)
            if parsed is None:
                log.lines -= 1
            elif isinstance(parsed, str):
                log.garbage += 1
                if len(log.garbage_examples) < 5:
                    log.garbage_examples.append(f"line {log.lines}: {parsed}: {line.strip()[:120]}")
            elif parsed.arm not in ARMS:
                log.unknown_arm += 1
            else:
                log.requests.append(parsed)
    return log
