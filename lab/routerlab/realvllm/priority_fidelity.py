"""Real vLLM (CPU) vs the simulator on priority scheduling (``--scheduling-policy priority`` and the
request body's ``priority``: lower runs first, ties by arrival).

    .venv/bin/python -m routerlab.realvllm.priority_fidelity --vllm-python /work/vllm-venv/bin/python \\
        --json /tmp/priority-fidelity.json --markdown /tmp/priority-fidelity.md

Needs a model made offline by :mod:`~routerlab.realvllm.tiny_model` (``MAKE_MODEL``: a larger shape than
the tiny model's, so that vLLM's front end keeps up). Then, one server at a time, starts a real vLLM
server and a simulator replica with the same flags (``--max-num-seqs 1``, so one request runs and the
others queue), twice: with the default policy (fcfs) and with ``--scheduling-policy priority``. On each
server:

* the answers to a chat completion with ``"priority": 0``, ``3`` and ``"high"`` (status, error type
  and message);
* the order of first tokens: A (streamed, ``--long-tokens`` tokens, ``ignore_eos``) runs; once its
  first chunk arrived B, C and D are sent, each once ``/metrics`` counts the one before waiting
  (``vllm:num_requests_waiting`` polled until it rises, with a deadline), each with a few tokens;
  the order in which B, C, D got their first chunk, and the cached tokens each reports (their prompts
  share a chain of blocks, so these are the server's own record of the order). With priorities A 0,
  B 5, C 0, D -1 (expected under the priority policy: D, C, B) and without priority fields (expected:
  B, C, D), on both servers. An attempt whose scene or client-side order does not hold is repeated.

One row per observation: real, sim, same. Exit 0 iff every compared row is the same (timings and the
validation error's wording are shown, not compared). ``--no-sim`` runs real vLLM only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from routerlab.realvllm.fidelity import SimProcess, comparison_lines, log
from routerlab.realvllm.launcher import DEFAULT_VLLM_PYTHON, VllmFleet
from routerlab.realvllm.lora_probes import Server, Stream, answer_of, completion_body, prompt_ids
from routerlab.realvllm.promtext import metric_sum
from routerlab.realvllm.tiny_model import is_complete

# Not the tiny model: it (hidden 128, 2 layers) decodes a token in about 1.5 ms on one core, faster
# than vLLM's front end serves its stream and /metrics on this 2-core machine, and B, C and D reached
# the engine only after A ended in most attempts (with hidden 512, 8 layers, 5 ms a token, still in
# most). This one (same maker, random weights, 137 MB) takes about 13 ms a token.
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "prefix-router-big-llama"
MAKE_MODEL = ("PYTHONPATH=lab {python} -m routerlab.realvllm.tiny_model --out {out} "
              "--hidden-size 1024 --layers 16")
BLOCK_SIZE = 128  # the CPU build's default
NUM_BLOCKS = 512
MAX_MODEL_LEN = 8192
POLICIES = ("fcfs", "priority")
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
# the order probe's requests and their priorities (None: no priority field)
WITH_PRIORITIES: dict[str, int | None] = {"A": 0, "B": 5, "C": 0, "D": -1}
WITHOUT_PRIORITIES: dict[str, int | None] = {"A": None, "B": None, "C": None, "D": None}
CHAINS = {"B": 1, "C": 2, "D": 3}  # blocks of the shared chain at the start of each prompt
# the order probe's observations that make an attempt valid
WAITED, A_RAN = "waiting counted after B, C, D were sent", "A still running when D was counted waiting"
ORDER, CACHED = "first-token order of B, C, D", "cached tokens of B, C, D"
ONE_AT_A_TIME = "B, C, D one at a time (each first chunk after the one before's last)"
# shown, not compared: client-side timings, the attempts an order probe took
INFORMATION_KEYS = {"A's last chunk to the next first chunk, ms", "gaps between first chunks in that order, ms",
                    "attempts", A_RAN}


def server_flags(policy: str) -> list[str]:
    """The flags real vLLM and the simulator both get beyond the common ones (the default policy:
    none)."""
    return [] if policy == "fcfs" else ["--scheduling-policy", policy]


def chat(server: Server, priority: Any) -> dict[str, Any]:
    """A one-token chat completion with this ``priority`` in its body: status, error type and message."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": 1, "temperature": 0, "priority": priority}
    status, raw = server.call("POST", "/v1/chat/completions", body)
    answer = answer_of(status, raw)
    answer.pop("json", None)  # a success's body (generated text) is not compared
    return answer


def _gauges(server: Server) -> tuple[float, float]:
    samples = server.scrape()
    return metric_sum(samples, WAITING), metric_sum(samples, RUNNING)


def first_token_order(times: dict[str, list[float]]) -> list[str]:
    """The names ordered by their first chunk's time (names that got none left out)."""
    return sorted((n for n in times if times[n]), key=lambda n: times[n][0])


def gaps_ms(times: dict[str, list[float]], order: list[str]) -> list[float]:
    """Milliseconds from each name's first chunk to the next one's, in ``order``."""
    return [round((times[b][0] - times[a][0]) * 1000, 1) for a, b in zip(order, order[1:])]


def one_at_a_time(spans: list[tuple[float, float]]) -> bool:
    """Whether each (first, last) chunk time span starts after the one before it ended."""
    return all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def expected_cached(order: list[str], chains: dict[str, int], block_size: int = BLOCK_SIZE) -> dict[str, int]:
    """The cached tokens each request reports if they ran in ``order``, when request X's prompt is the
    first ``chains[X]`` blocks of one shared chain plus a tail of its own shorter than a block: the
    longest chain prefix an earlier request computed (prefix caching; nothing evicted)."""
    out: dict[str, int] = {}
    for i, name in enumerate(order):
        out[name] = max((min(chains[name], chains[p]) for p in order[:i]), default=0) * block_size
    return out


def order_prompts(seed: int, chains: dict[str, int], block_size: int = BLOCK_SIZE) -> dict[str, list[int]]:
    """Each request's token-id prompt: its first ``chains[name]`` blocks of one chain (distinct per
    ``seed``), then 10 tokens of its own."""
    chain = prompt_ids(seed, block_size * max(chains.values()))
    return {n: chain[:k * block_size] + prompt_ids(seed + 1 + i, 10) for i, (n, k) in enumerate(chains.items())}


def order_attempt(server: Server, priorities: dict[str, int | None], long_tokens: int, short_tokens: int,
                  seed: int, timeout: float = 60.0) -> dict[str, Any]:
    """One attempt: A runs (``long_tokens``); after its first chunk B, C, D are sent one by one, each
    once the server counts one more request waiting (or the deadline passed, or it ended: then the
    next is sent anyway and the row shows it); /metrics is not read while B, C, D run. Their prompts
    share a block chain (B 1 block, C 2, D 3), so the cached tokens each reports tell the server's own
    order apart (:func:`expected_cached`: every order but D, B, C vs D, C, B)."""
    prompts = order_prompts(seed, CHAINS)

    def body(name: str, prompt: list[int], tokens: int) -> dict[str, Any]:
        p = priorities[name]
        return completion_body(server.model, prompt, tokens, **({} if p is None else {"priority": p}))

    streams = {"A": Stream(server, body("A", prompt_ids(seed + 50, 32), long_tokens)).first_token()}
    waiting_after: list[float | None] = []
    most_running = 0.0
    for i, name in enumerate(("B", "C", "D"), start=1):
        streams[name] = Stream(server, body(name, prompts[name], short_tokens))
        deadline = time.monotonic() + timeout
        reached: float | None = None
        while time.monotonic() < deadline and not streams[name].done.is_set():
            waiting, running = _gauges(server)
            most_running = max(most_running, running)
            if waiting >= i:
                reached = waiting
                break
            time.sleep(0.02)
        waiting_after.append(reached)
    a_running = not streams["A"].done.is_set()
    for s in streams.values():
        s.join()
    times = {n: s.times for n, s in streams.items() if n != "A"}
    order = first_token_order(times)
    a_last = streams["A"].times[-1] if streams["A"].times else None
    cached = {n: (s.usage.get("prompt_tokens_details") or {}).get("cached_tokens") for n, s in streams.items()
              if n != "A"}
    return {
        "status A, B, C, D": [s.status for s in streams.values()],
        "tokens A, B, C, D": [s.usage.get("completion_tokens") for s in streams.values()],
        WAITED: waiting_after,
        A_RAN: a_running,
        "most requests running while B, C, D were sent": most_running,
        ORDER: order,
        CACHED: [cached[n] for n in ("B", "C", "D")],
        ONE_AT_A_TIME: one_at_a_time([(times[n][0], times[n][-1]) for n in order]),
        "A's last chunk to the next first chunk, ms": round((times[order[0]][0] - a_last) * 1000, 1)
        if order and a_last is not None else None,
        "gaps between first chunks in that order, ms": gaps_ms(times, order),
    }


def attempt_valid(obs: dict[str, Any]) -> bool:
    """Whether an attempt set the scene (B, C, D all counted waiting while A ran) and the client's
    order of first chunks agrees with the server's (the cached tokens that order implies) and with
    one request at a time: a client thread starved for a moment can see chunks late and out of order."""
    order = obs[ORDER]
    if obs[WAITED] != [1, 2, 3] or sorted(order) != ["B", "C", "D"] or not obs[ONE_AT_A_TIME]:
        return False
    want = expected_cached(order, CHAINS)
    return obs[CACHED] == [want[n] for n in ("B", "C", "D")]


def order_probe(server: Server, priorities: dict[str, int | None], long_tokens: int, short_tokens: int,
                seed: int, attempts: int = 4) -> dict[str, Any]:
    """:func:`order_attempt` until one is valid (:func:`attempt_valid`), at most ``attempts`` times
    (each with its own prompts: nothing cached from the one before); the last one's observations."""
    for n in range(1, attempts + 1):
        obs = order_attempt(server, priorities, long_tokens, short_tokens, seed + 100 * n)
        obs["attempts"] = n
        if attempt_valid(obs):
            break
        log(f"[priority-fidelity] attempt {n} not valid: {obs}")
    return obs


def observe(server: Server, policy: str, long_tokens: int, short_tokens: int) -> dict[str, Any]:
    """Every probe on one fresh server."""
    probes: dict[str, Callable[[], Any]] = {
        "chat priority 0": lambda: chat(server, 0),
        "chat priority 3": lambda: chat(server, 3),
        "chat priority \"high\"": lambda: chat(server, "high"),
        "order, priorities A 0, B 5, C 0, D -1": lambda: order_probe(server, WITH_PRIORITIES, long_tokens,
                                                                    short_tokens, seed=10),
        "order, no priority fields": lambda: order_probe(server, WITHOUT_PRIORITIES, long_tokens, short_tokens,
                                                         seed=20),
    }
    out = {}
    for name, probe in probes.items():
        log(f"[priority-fidelity] {policy} {server.url}: {name}")
        out[name] = probe()
    return out


def rows(real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]] | None) -> list[dict[str, Any]]:
    """One row per observation: ``real[policy][probe]`` against the same place in ``sim`` (None: no
    simulator run, nothing compared); a dict observation gives one row per key. Timings and the
    message of a validation error (pydantic's wording) are information, not compared."""
    out = []
    for policy, probes in real.items():
        for probe, value in probes.items():
            other = (sim or {}).get(policy, {}).get(probe)
            for key, r in value.items():
                check = f"{policy}: {probe}: {key}"
                s = other.get(key) if isinstance(other, dict) else None
                # the message of a body the request model rejects is pydantic's wording: shown only
                info = sim is None or key in INFORMATION_KEYS or (key == "message" and probe.endswith('"high"'))
                out.append({"check": check, "real": r, "sim": s, "same": None if info else r == s})
    return out


def differences(table: list[dict[str, Any]]) -> list[str]:
    return [r["check"] for r in table if r["same"] is False]


def markdown(table: list[dict[str, Any]]) -> str:
    return "\n".join(comparison_lines(table)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.priority_fidelity",
                                description="real vLLM vs simulator: priority scheduling")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model dir (see MAKE_MODEL)")
    p.add_argument("--long-tokens", type=int, default=512,
                   help="tokens of A, the request that holds the slot while B, C, D queue")
    p.add_argument("--short-tokens", type=int, default=32, help="tokens of B, C and D")
    p.add_argument("--vllm-port", type=int, default=8292)
    p.add_argument("--sim-python", default=sys.executable, help="python for `-m extproc sim`")
    p.add_argument("--sim-port", type=int, default=8392)
    p.add_argument("--sim-time-scale", type=float, default=1.0, help="the simulator's --time-scale")
    p.add_argument("--no-sim", action="store_true", help="real vLLM only (nothing compared)")
    p.add_argument("--json", default=None, help="write the observations and rows here")
    p.add_argument("--markdown", default=None, help="write the table here")
    a = p.parse_args(argv)

    model = str(Path(a.model).resolve())
    if not is_complete(Path(model)):
        print(f"no model in {model}: make it with (from the repository)\n"
              + MAKE_MODEL.format(python=a.vllm_python, out=model), file=sys.stderr)
        return 2
    started = time.monotonic()
    real: dict[str, dict[str, Any]] = {}
    sim: dict[str, dict[str, Any]] | None = None if a.no_sim else {}
    for policy in POLICIES:
        fleet = VllmFleet(model, 1, a.vllm_port, a.vllm_python, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                          max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=1,
                          prompt_tokens_details=True, extra_args=server_flags(policy))
        try:
            url = fleet.start()[0]
            real[policy] = observe(Server(url, model, {}), policy, a.long_tokens, a.short_tokens)
        finally:
            fleet.stop()
        if sim is not None:
            proc = SimProcess(a.sim_python, a.sim_port, BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN,
                              time_scale=a.sim_time_scale, max_model_len=MAX_MODEL_LEN,
                              extra_args=["--model", model, "--max-num-seqs", "1", *server_flags(policy)])
            try:
                sim[policy] = observe(Server(proc.start(), model, {}), policy, a.long_tokens, a.short_tokens)
            finally:
                proc.stop()
    seconds = round(time.monotonic() - started)
    table = rows(real, sim)
    text = markdown(table)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"long_tokens": a.long_tokens, "short_tokens": a.short_tokens,
                                            "sim_time_scale": a.sim_time_scale, "seconds": seconds,
                                            "real": real, "sim": sim, "rows": table}, indent=1))
    bad = differences(table)
    if sim is None:
        print(f"PRIORITY FIDELITY: real vLLM only ({seconds} s)")
        return 0
    print(f"PRIORITY FIDELITY OK ({seconds} s)" if not bad else f"PRIORITY FIDELITY DIFFERS: {', '.join(bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
