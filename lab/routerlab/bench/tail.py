"""Where a run's slow requests come from: for each request, what was ahead of it on its replica.

From the client's records alone (``requests/ARM.jsonl``: start, time to first token, replica,
prompt and cached tokens): a request arriving on a replica waits behind the requests there that
have not produced their first token yet (vLLM's FCFS prefill), so

    ahead(i)        = requests on i's replica with start < start(i) < their first token
    ahead_prefill   = the prompt tokens those still had to compute (prompt - cached)
    running(i)      = requests on i's replica in flight when i arrived (for the max_num_seqs slot)
    idle_elsewhere  = another replica had nothing ahead at that moment (a choice that avoided the
                      wait existed)
    ahead_left      = of ahead_prefill, what was still to compute then (each one's share of its
                      time to first token still to run)

The slowest tenth (TTFT at or above the arm's p90) is then counted by cache hit or miss and by
what was ahead. ``python -m routerlab.bench.tail OUT [--arm NAME]`` prints the table for a bench
output directory and draws ``tail-ARM.png`` there (one row per replica over time).
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.pick.choice.load import LoadTracker

HIT_SHARE = 0.5  # a request with at least this share of its prompt cached counts as a hit


@dataclass(frozen=True, slots=True)
class Placed:
    """One request, as the tail analysis sees it (times in seconds from the run's start)."""

    rid: int
    replica: str
    start: float
    ttft: float
    e2e: float
    prompt_tokens: int
    cached_tokens: int
    to_replica: float | None = None  # send to the replica's server having it whole (simulated replicas only)

    @property
    def hit(self) -> bool:
        return self.prompt_tokens > 0 and self.cached_tokens >= HIT_SHARE * self.prompt_tokens

    @property
    def first_token(self) -> float:
        return self.start + self.ttft

    @property
    def prefill(self) -> int:
        return max(self.prompt_tokens - self.cached_tokens, 0)


@dataclass(frozen=True, slots=True)
class Context:
    """What was on a request's replica (and the others) when it arrived."""

    request: Placed
    ahead: int
    ahead_prefill: int
    running: int
    idle_elsewhere: bool
    ahead_left: float = 0.0  # of ahead_prefill, what was still to compute (each share of its TTFT left)


def load(path: Path) -> list[Placed]:
    """The successful requests of one arm's ``requests/ARM.jsonl``."""
    out = []
    for line in path.read_bytes().splitlines():
        r = orjson.loads(line)
        if r.get("ok") and r.get("ttft") is not None and r.get("replica"):
            out.append(Placed(r["rid"], r["replica"], r["start"], r["ttft"], r.get("e2e") or r["ttft"],
                              r.get("prompt_tokens", 0), r.get("cached_tokens", 0), r.get("to_replica")))
    return out


def contexts(requests: Sequence[Placed]) -> list[Context]:
    """Each request with what was ahead of it on its replica when it arrived."""
    by_replica: dict[str, list[Placed]] = defaultdict(list)
    for r in sorted(requests, key=lambda r: r.start):
        by_replica[r.replica].append(r)
    starts = {a: [r.start for r in rs] for a, rs in by_replica.items()}
    out = []
    for r in requests:
        earlier = by_replica[r.replica][:bisect.bisect_left(starts[r.replica], r.start)]
        waiting = [j for j in earlier if j.first_token > r.start]
        running = sum(1 for j in earlier if j.start + j.e2e > r.start)
        idle = any(not any(j.start < r.start < j.first_token for j in rs[:bisect.bisect_left(starts[a], r.start)])
                   for a, rs in by_replica.items() if a != r.replica)
        left = sum(j.prefill * min(1.0, (j.first_token - r.start) / j.ttft) for j in waiting if j.ttft > 0)
        out.append(Context(r, len(waiting), sum(j.prefill for j in waiting), running, idle, left))
    return out


def queue_estimates(requests: Sequence[Placed], token_scale: float, rate: float) -> dict[int, float]:
    """What a router's queued-prefill estimate said about each request's replica when it arrived,
    replayed from the records through the router's own load view (extproc.pick.choice.load): each
    request adds its prefill (prompt - cached) times ``token_scale`` (the router's token count
    against the replica's: 4 bytes per token guessed where the tokenizer makes 1.91 gives 0.48),
    drained at ``rate`` tokens/s, and takes it off when it ends (an approximation: client-side
    times, the prefill the replica reported rather than the one the router predicted)."""
    tracker = LoadTracker(rate)
    tracker.set_addresses(sorted({r.replica for r in requests}))
    starts = [(r.start, 1, r) for r in requests]
    ends = [(r.start + r.e2e, 0, r) for r in requests]  # at a tie, an end comes before a start
    out = {}
    for at, kind, r in sorted(starts + ends, key=lambda e: (e[0], e[1])):
        prefill = round(max(r.prefill, 1) * token_scale)
        if kind:
            out[r.rid] = float(tracker.snapshot(at).by_address()[r.replica].backlog_tokens)
            tracker.assign(r.replica, prefill, at)
        else:
            tracker.release(r.replica, prefill, at)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


CLASSES: tuple[tuple[str, Any], ...] = (
    ("hit, nothing ahead", lambda c: c.request.hit and not c.ahead),
    ("hit, queued", lambda c: c.request.hit and c.ahead),
    ("miss, nothing ahead", lambda c: not c.request.hit and not c.ahead),
    ("miss, queued", lambda c: not c.request.hit and c.ahead),
)


def summary(ctx: Sequence[Context], line: float | None = None) -> dict[str, Any]:
    """The slowest tenth against the rest, by hit or miss and by what was ahead; with ``line``
    (seconds, say another arm's p90), how many of each class took longer than it."""
    if not ctx:
        return {"requests": 0}
    p90 = percentile([c.request.ttft for c in ctx], 90)
    slow = [c for c in ctx if c.request.ttft >= p90]

    def share(group: Iterable[Context], test: Any) -> float:
        items = list(group)
        return round(sum(1 for c in items if test(c)) / len(items), 3) if items else 0.0

    def classes(group: Sequence[Context]) -> dict[str, dict[str, float]]:
        out = {}
        for name, test in CLASSES:
            members = [c for c in group if test(c)]
            out[name] = {"share": round(len(members) / len(group), 3) if group else 0.0,
                         "ttft_p50_ms": round(1000 * percentile([c.request.ttft for c in members], 50), 1)}
            ways = [c.request.to_replica for c in members if c.request.to_replica is not None]
            if ways:
                out[name]["to_replica_p50_ms"] = round(1000 * percentile(ways, 50), 2)
                out[name]["to_replica_p90_ms"] = round(1000 * percentile(ways, 90), 2)
            if line is not None:
                out[name]["above_line"] = sum(1 for c in members if c.request.ttft > line)
        return out

    return {
        "requests": len(ctx),
        "ttft_p90_ms": round(1000 * p90, 1),
        **({"line_ms": round(1000 * line, 1)} if line is not None else {}),
        "slow": len(slow),
        "classes": classes(ctx),
        "slow_classes": classes(slow),
        "slow_hit_share": share(slow, lambda c: c.request.hit),
        "slow_queued_share": share(slow, lambda c: c.ahead > 0),
        "slow_queued_with_idle_elsewhere": share([c for c in slow if c.ahead], lambda c: c.idle_elsewhere),
        "slow_ahead_prefill_p50": percentile([float(c.ahead_prefill) for c in slow], 50),
        "slow_running_max": max((c.running for c in slow), default=0),
        "hit_share": share(ctx, lambda c: c.request.hit),
        "queued_share": share(ctx, lambda c: c.ahead > 0),
    }


def to_markdown(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per arm and class: share of all requests, share of the slowest tenth, TTFT p50; the
    way to the replica and the count above the line where the summaries have them."""
    ways = any("to_replica_p50_ms" in c for s in summaries.values() for c in s.get("classes", {}).values())
    line = next((s["line_ms"] for s in summaries.values() if "line_ms" in s), None)
    head = "| arm | TTFT p90 ms | class | of all | of the slowest 10 % | its TTFT p50 ms |"
    rule = "|---|---:|---|---:|---:|---:|"
    if ways:
        head += " to the replica p50 / p90 ms |"
        rule += "---:|"
    if line is not None:
        head += f" above {line} ms |"
        rule += "---:|"
    lines = [head, rule]
    for arm, s in summaries.items():
        if not s.get("requests"):
            continue
        for name, c in s["classes"].items():
            row = (f"| {arm} | {s['ttft_p90_ms']} | {name} | {c['share']:.0%} | "
                   f"{s['slow_classes'][name]['share']:.0%} | {c['ttft_p50_ms']} |")
            if ways:
                row += (f" {c['to_replica_p50_ms']} / {c['to_replica_p90_ms']} |" if "to_replica_p50_ms" in c
                        else " |")
            if line is not None:
                row += f" {c.get('above_line', '')} |"
            lines.append(row)
    lines.append("")
    lines.append("| arm | slow and queued: another replica had nothing ahead | slow: prefill tokens ahead (p50) "
                 "| slow: most requests running on the replica |")
    lines.append("|---|---:|---:|---:|")
    for arm, s in summaries.items():
        if s.get("requests"):
            lines.append(f"| {arm} | {s['slow_queued_with_idle_elsewhere']:.0%} | {s['slow_ahead_prefill_p50']:.0f} | "
                         f"{s['slow_running_max']} |")
    return "\n".join(lines) + "\n"


def plot(panels: Sequence[tuple[str, Sequence[Context]]], path: Path,
         window: tuple[float, float] | None = None) -> None:
    """One panel per (title, requests), one row per replica: each request a bar from its arrival to
    its first token (green: a hit, red: a miss; dark: among that panel's slowest tenth), over
    ``window`` seconds of the run (default: 20 s from the middle of the first panel's run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(t, c) for t, c in panels if c]
    if not panels:
        return
    end = max(c.request.first_token for c in panels[0][1])
    lo, hi = window or (end / 2 - 10, end / 2 + 10)
    rows = [len({c.request.replica for c in ctx}) for _, ctx in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.9 + 0.9 * sum(rows)), layout="constrained",
                             squeeze=False, height_ratios=rows)
    try:
        for ax, (title, ctx) in zip(axes[:, 0], panels):
            _draw(ax, ctx, lo, hi, title)
        axes[-1, 0].set_xlabel("seconds into the run (a bar: arrival to first token)")
        axes[0, 0].legend(handles=[Patch(color="#7fbf7b", label="hit"),
                                   Patch(color="#1b7837", label="hit, slowest 10 %"),
                                   Patch(color="#ef8a62", label="miss"),
                                   Patch(color="#b2182b", label="miss, slowest 10 %")],
                          loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def _draw(ax: Any, ctx: Sequence[Context], lo: float, hi: float, title: str) -> None:
    p90 = percentile([c.request.ttft for c in ctx], 90)
    replicas = sorted({c.request.replica for c in ctx})
    lanes: dict[str, list[float]] = {a: [] for a in replicas}  # when each lane of a replica's row frees
    for c in sorted(ctx, key=lambda c: c.request.start):
        r = c.request
        if r.first_token < lo or r.start > hi:
            continue
        row = lanes[r.replica]
        lane = next((i for i, t in enumerate(row) if t <= r.start), len(row))
        row[lane:lane + 1] = [r.first_token]
        y = replicas.index(r.replica) + 0.1 + 0.8 * min(lane, 5) / 6
        slow = r.ttft >= p90
        colour = ("#1b7837" if slow else "#7fbf7b") if r.hit else ("#b2182b" if slow else "#ef8a62")
        ax.broken_barh([(r.start, r.ttft)], (y, 0.8 / 6 * 0.9), facecolors=colour)
    ax.set_xlim(lo, hi)
    ax.set_yticks([i + 0.5 for i in range(len(replicas))], [f"replica {i}" for i in range(len(replicas))])
    ax.set_ylim(0, len(replicas))
    ax.set_title(f"{title}: TTFT p90 {1000 * p90:.0f} ms", fontsize=10)


def analyse(out: Path, arms: Sequence[str] = (), against: str = "") -> dict[str, dict[str, Any]]:
    """Every (or the named) arm's summary from a bench output directory; draws tail-ARM.png for each.
    ``against``: an arm whose TTFT p90 is the line each class is counted above."""
    paths = sorted((out / "requests").glob("*.jsonl"))
    found = {p.stem: p for p in paths if not arms or p.stem in arms or p.stem == against}
    line = None
    if against:
        if against not in found:
            raise ValueError(f"no requests/{against}.jsonl in {out}")
        line = percentile([r.ttft for r in load(found[against])], 90)
    result = {}
    for arm, path in found.items():
        ctx = contexts(load(path))
        result[arm] = summary(ctx, line)
        plot([(arm, ctx)], out / f"tail-{arm}.png")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerlab.bench.tail", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="a bench output directory (with requests/ARM.jsonl)")
    parser.add_argument("--arm", action="append", default=[], help="only this arm (repeatable)")
    parser.add_argument("--against", metavar="ARM", default="",
                        help="count each class's requests slower than this arm's TTFT p90 (e.g. round-robin)")
    parser.add_argument("--queue-estimate", metavar="SCALE,RATE", default="",
                        help="also replay a router's queued-prefill estimate (its tokens per replica token, "
                             "its drain rate) and print what it said at the slow queued misses' arrivals")
    args = parser.parse_args(argv)
    if not (args.out / "requests").is_dir():
        parser.error(f"{args.out}/requests: no per-request records (run bench with --out)")
    try:
        summaries = analyse(args.out, args.arm, args.against)
    except ValueError as exc:
        parser.error(str(exc))
    print(to_markdown(summaries))
    if args.queue_estimate:
        scale, rate = (float(x) for x in args.queue_estimate.split(","))
        for arm, path in sorted((p.stem, p) for p in (args.out / "requests").glob("*.jsonl")):
            if args.arm and arm not in args.arm:
                continue
            requests = load(path)
            seen, ctx = queue_estimates(requests, scale, rate), contexts(requests)
            p90 = percentile([c.request.ttft for c in ctx], 90)
            slow = [c for c in ctx if c.request.ttft >= p90 and c.ahead and not c.request.hit]
            ratios = [seen[c.request.rid] / max(c.ahead_left, 1.0) for c in slow]
            summaries[arm]["slow_queued_miss_seen_over_ahead_p50"] = round(percentile(ratios, 50), 2)
            print(f"{arm}: at the {len(slow)} slow queued misses' arrivals the estimate held a median "
                  f"{percentile(ratios, 50):.0%} of the prefill still ahead")
    (args.out / "tail.json").write_bytes(orjson.dumps(summaries, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
