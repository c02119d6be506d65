"""A request's cost in counts that do not drift with the machine: CPU instructions and cache misses.

The microbench's microseconds move by 20 % between runs of the same code here (a shared virtual
machine), so a change worth a few percent cannot be seen in them. This tool runs the request path
of ``--mode`` under valgrind's cachegrind twice, ``--requests`` apart, and prints the difference
per request: instructions executed (Ir), first-level instruction and data cache misses, data
reads and writes, and last-level data misses (cachegrind's simulated caches, not this machine's).
The counts repeat exactly from run to run (the hash seed fixed); they miss what a real CPU overlaps or stalls on, so
they rank changes, and time is still read from the microbench.

Modes, 8 replicas, a ``--kb`` chat body each request with a new 30-word question on one system prompt:

- ``pick``: pick mode's decide() + choice (the microbench's pick row, 300 prompts warmed).
- ``precise``: precise mode's decide() + choice (the microbench's precise row).
- ``precise-served``: the same with ``PreciseView.missing`` first, as the adapter's ``prepare`` asks.
- ``precise-turn``: precise mode's decide() + choice for a conversation's next turn after 40 (the
  microbench's turns table: 32 conversations on one 8 KB system prompt; ``--kb`` is not used).

Run: ``.venv/bin/python lab/tools/request_instructions.py --mode precise`` (needs valgrind; each
mode takes about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

EVENTS = ((r"I\s+refs", "instructions"), (r"I1\s+misses", "I1 misses"), (r"D\s+refs", "data refs"),
          (r"D1\s+misses", "D1 misses"), (r"LLd\s+misses", "LL data misses"))
WARM = 300
MAX_REQUESTS = 1000  # bodies made in every run alike, so both runs do the same set-up


def request(mode: str, kb: int) -> Callable[[], None]:
    """The request path of ``mode`` as a callable (bodies for up to ``MAX_REQUESTS`` + 20 calls after
    the warm-up)."""
    from extproc.core.decide import decide
    from extproc.core.settings import RouteSettings
    from extproc.pick.tokens.prompt_tokens import ModelTokenizer
    from routerlab.assets import TINY_BYTELEVEL
    from routerlab.bench import microbench as mb
    from routerlab.bench.micro.precise import precise_of

    if mode == "pick":
        return mb.pick_request(kb, 8, WARM)[1]
    settings = RouteSettings(mode="pick")
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    if mode == "precise-turn":
        warm, turns = mb.conversation_bodies(40, MAX_REQUESTS + 20 + WARM)
        core = mb.precise_core(tokenizer, 8, tokenizer.token_array(json.loads(warm[0]), "chat").tolist())
        for body in warm:
            core.release(core.pick(decide(body, {}, settings), settings))
        bodies = iter(turns)
        return lambda: core.release(core.pick(decide(next(bodies), {}, settings), settings))
    system = json.loads(mb.chat_body(kb * 1024, 0))["messages"][0]["content"]
    bodies = iter(mb.questions(system, MAX_REQUESTS + 20 + WARM + 1))
    core = mb.precise_core(tokenizer, 8, tokenizer.token_array(json.loads(next(bodies)), "chat").tolist())
    served = mode == "precise-served"
    precise = precise_of(core)

    def once() -> None:
        decision = decide(next(bodies), {}, settings)
        if served:
            precise.missing(decision)
        core.release(core.pick(decision, settings))
    return once


def child(mode: str, kb: int, n: int) -> None:
    once = request(mode, kb)
    for _ in range(WARM + n):
        once()


def counts(mode: str, kb: int, n: int) -> dict[str, int]:
    """cachegrind's totals for the whole process of ``n`` requests after the warm-up."""
    run = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--child", "--mode", mode, "--kb", str(kb), "--requests", str(n)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    out = {}
    for key, name in EVENTS:
        m = re.search(rf"{key}:\s+([\d,]+)", run.stderr)
        if m is None:
            raise SystemExit(f"valgrind printed no {key!r}:\n{run.stderr[-2000:]}")
        out[name] = int(m.group(1).replace(",", ""))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("pick", "precise", "precise-served", "precise-turn"), default="precise")
    p.add_argument("--kb", type=int, default=32, help="the body's size")
    p.add_argument("--requests", type=int, default=100, help="requests between the two runs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if not 0 < a.requests <= MAX_REQUESTS:
        p.error(f"--requests must be in 1..{MAX_REQUESTS}")
    sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
    if a.child:
        child(a.mode, a.kb, a.requests)
        return 0
    base, more = counts(a.mode, a.kb, 20), counts(a.mode, a.kb, 20 + a.requests)
    per = {name: (more[name] - base[name]) / a.requests for name in more}
    print(f"{a.mode}, {a.kb} KB body, per request (valgrind cachegrind, {a.requests} requests): "
          + ", ".join(f"{name} {value:,.0f}" for name, value in per.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
