"""Synthetic A/B runs with a known effect: Envoy JSON access-log lines and windows files."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

T0 = 1_800_000_000.0


def stamp(t: float) -> str:
    """Envoy's %START_TIME%: 2027-01-15T08:00:00.123Z."""
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def line(t: float, arm: str, ttft: float | None, session: str = "s0", status: int | str = 200,
         host: str = "127.0.0.1:8101") -> str:
    return json.dumps({"start_time": stamp(t), "arm": arm, "session": session, "tenant": "-", "upstream_host": host,
                       "upstream_cluster": "vllm" if arm == "prefix" else "vllm_stock", "status": status,
                       "ttft_ms": "-" if ttft is None else round(ttft, 3), "duration_ms": 900,
                       "path": "/v1/chat/completions"})


def switchback(tmp: Path, windows: int = 12, effect: float = 0.5, seed: int = 0, per_window: int = 40,
               window_s: float = 60.0, burn_in: float = 10.0, window_sd: float = 0.25,
               hit: tuple[float, float] = (0.6, 0.9), reset_in: int | None = None) -> tuple[Path, Path]:
    """``windows`` windows in balanced pairs; stock TTFT median 100 ms, prefix 100 * effect;
    each window's level drawn around its arm's (``window_sd`` on the log scale). Counters of
    two replicas at each edge; ``reset_in``: replica 2 restarts in that window."""
    rng = np.random.default_rng(seed)
    log, wins = tmp / "access.log", tmp / "windows.jsonl"
    lines, docs = [], [json.dumps({"kind": "run", "design": "switchback", "burn_in": burn_in})]
    counters = {"http://r1": [0.0, 0.0], "http://r2": [0.0, 0.0]}

    def snap() -> dict:
        return {u: {"queries": q, "hits": h, "success": 0.0, "running": 0.0} for u, (q, h) in counters.items()}

    for i in range(windows):
        pair = rng.permutation(["prefix", "stock"]) if i % 2 == 0 else pair  # noqa: F821 (set on even i)
        arm = str(pair[i % 2])
        start = T0 + i * window_s
        level = 100.0 * (effect if arm == "prefix" else 1.0) * np.exp(rng.normal(0, window_sd))
        for t in np.sort(rng.uniform(start, start + window_s, per_window)):
            lines.append(line(float(t), arm, float(level * np.exp(rng.normal(0, 0.5))), session=f"w{i}"))
        edges = {"start": snap()}
        rate = hit[1] if arm == "prefix" else hit[0]
        for u in counters:  # burn-in traffic, then the measured part
            counters[u][0] += 1000
            counters[u][1] += 1000 * rate
        edges["measure"] = snap()
        if reset_in == i:
            counters["http://r2"] = [0.0, 0.0]
        for u in counters:
            q = 4000 * (1 + 0.1 * rng.normal())
            counters[u][0] += q
            counters[u][1] += q * float(np.clip(rate + 0.03 * rng.normal(), 0, 1))
        edges["end"] = snap()
        docs.append(json.dumps({"index": i, "arm": arm, "start": start, "end": start + window_s, "burn_in": burn_in,
                                "counters": {"fleet": edges}}))
    log.write_text("\n".join(lines) + "\n")
    wins.write_text("\n".join(docs) + "\n")
    return log, wins


def sessions(rng: np.random.Generator, arm: str, count: int, turns: int, level: float, session_sd: float,
             t0: float = T0) -> list[str]:
    """``count`` sessions of ``turns`` requests; each session's TTFT level drawn around ``level``."""
    out = []
    for s in range(count):
        mine = level * np.exp(rng.normal(0, session_sd))
        for k in range(turns):
            out.append(line(t0 + s * 7.0 + k, arm, float(mine * np.exp(rng.normal(0, 0.2))), session=f"{arm}-{s}"))
    return out
