"""Simulator fidelity: replay one token-id trace against real vLLM (CPU) and the simulator.

    python -m routerlab.realvllm.fidelity --vllm-python /work/vllm-venv/bin/python \\
        [--model DIR] [--requests N] [--seed S] [--evict] [--json FILE]

1. makes the tiny model if ``--model`` is missing or incomplete (with the vLLM venv's python);
2. starts one real vLLM server (``--num-gpu-blocks``, default 512, so the eviction phase is
   cheap), reads ``block_size`` and ``num_gpu_blocks`` from its ``vllm:cache_config_info``;
3. starts one simulator replica (``python -m extproc sim``) with that block size and
   number of blocks;
4. sends the trace of :mod:`routerlab.realvllm.trace` to both, one request at a time
   (``/v1/completions``, token-id prompt, ``max_tokens: 1``, temperature 0, optional
   ``cache_salt``) and after each reads ``vllm:prefix_cache_queries_total`` and
   ``vllm:prefix_cache_hits_total`` from both /metrics;
5. prints a request-by-request table (and the reference model's expectation), a summary,
   and with ``--json FILE`` writes the rows.

Exit status 0 iff real vLLM and the simulator agree on every request of the ``fit``
(non-evicting) phase. The ``evict`` phase (``--evict``) is reported but not part of the status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from routerlab import REPO_DIR
from routerlab.realvllm import promtext
from routerlab.realvllm.launcher import DEFAULT_VLLM_PYTHON, VllmFleet, _port_free
from routerlab.realvllm.tiny_model import ensure_tiny_model
from routerlab.realvllm.trace import Trace, TraceRequest, build_trace

DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "prefix-router-tiny-llama"


@dataclass
class Row:
    index: int
    phase: str
    label: str
    prompt_tokens: int
    cache_salt: str | None
    real_queries: int
    real_hits: int
    sim_queries: int | None
    sim_hits: int | None
    ref_queries: int
    ref_hits: int
    real_ms: float
    sim_ms: float | None
    real_usage_prompt_tokens: int | None
    match: bool | None  # real == sim (None without a simulator)
    ref_match: bool  # real == reference model


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def comparison_lines(table: list[dict[str, Any]]) -> list[str]:
    """A markdown table of real vs simulator rows (``check``, ``real``, ``sim``, ``same``: True, False or
    None for information; ``known``: a difference known and listed)."""
    def cell(v: Any) -> str:
        text = v if isinstance(v, str) else json.dumps(v, separators=(", ", ":"))
        return " ".join(text.split()).replace("|", "\\|")[:400]  # one line: a cell holds no newline

    lines = ["| check | real vLLM | simulator | same |", "|---|---|---|---|"]
    for r in table:
        same = {True: "yes", None: "(information)"}.get(r["same"]) or ("no (known)" if r.get("known") else "**no**")
        lines.append(f"| {r['check']} | {cell(r['real'])} | {cell(r['sim'])} | {same} |")
    return lines


class SimProcess:
    """One simulator replica started as ``python -m extproc sim`` (stopped by PID)."""

    def __init__(self, python: str, port: int, block_size: int, num_blocks: int,
                 max_num_batched_tokens: int, time_scale: float, profile: str = "tiny",
                 max_model_len: int = 8192,
                 logfile: Path | None = None, extra_args: Sequence[str] = ()) -> None:
        """``extra_args``: more ``sim`` flags, appended as is (e.g. the LoRA ones)."""
        self.python, self.port = python, port
        self.cmd = [python, "-m", "extproc", "sim", "--replicas", "1", "--base-port", str(port),
                    "--profile", profile, "--block-size", str(block_size),
                    "--num-blocks", str(num_blocks),
                    "--max-num-batched-tokens", str(max_num_batched_tokens),
                    "--max-model-len", str(max_model_len),
                    "--time-scale", str(time_scale), *extra_args]
        if logfile is None:
            fd, name = tempfile.mkstemp(prefix="sim-", suffix=".log")
            os.close(fd)  # only the name is needed: start() opens it for the child
            logfile = Path(name)
        self.logfile = logfile
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> str:
        if not _port_free("127.0.0.1", self.port):
            raise RuntimeError(f"port {self.port} in use")
        with open(self.logfile, "wb") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=str(REPO_DIR),
                                         start_new_session=True)
        log(f"[sim] pid {self.proc.pid}: {' '.join(self.cmd[1:])}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited with {self.proc.returncode}:\n"
                                   + self.logfile.read_text(errors="replace")[-3000:])
            try:
                status, _ = promtext.http_get(self.url + "/health", timeout=2.0)
                if status == 200:
                    return self.url
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"simulator not healthy after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        log(f"[sim] stopped pid {self.proc.pid}")
        self.proc = None


def send_and_count(url: str, model: str, req: TraceRequest,
                   settle_timeout: float = 5.0) -> tuple[int, int, float, dict | str]:
    """Send one request; returns (queries delta, hits delta, latency ms, response body).

    The counters are read until the queries counter has moved (vLLM updates its Prometheus
    counters just after the response may have been sent), bounded by ``settle_timeout``.
    """
    q0, h0 = promtext.prefix_counters(url)
    t0 = time.perf_counter()
    status, body = promtext.http_post_json(url + "/v1/completions", req.payload(model), timeout=300)
    ms = (time.perf_counter() - t0) * 1000.0
    if status != 200:
        raise RuntimeError(f"{url}: request {req.index} ({req.label}) -> {status}: {str(body)[:500]}")
    deadline = time.monotonic() + settle_timeout
    q1, h1 = promtext.prefix_counters(url)
    while q1 == q0 and time.monotonic() < deadline:
        time.sleep(0.02)
        q1, h1 = promtext.prefix_counters(url)
    time.sleep(0.02)
    q1, h1 = promtext.prefix_counters(url)  # settle: take the last word
    return int(round(q1 - q0)), int(round(h1 - h0)), ms, body


def run_trace(trace: Trace, real_url: str, real_model: str, sim_url: str | None,
              sim_model: str | None) -> list[Row]:
    rows: list[Row] = []
    for req, exp in zip(trace.requests, trace.expected):
        rq, rh, rms, body = send_and_count(real_url, real_model, req)
        usage = body.get("usage", {}).get("prompt_tokens") if isinstance(body, dict) else None
        sq = sh = None
        sms = None
        if sim_url is not None:
            sq, sh, sms, _ = send_and_count(sim_url, sim_model or real_model, req)
        row = Row(
            index=req.index, phase=req.phase, label=req.label, prompt_tokens=len(req.prompt),
            cache_salt=req.cache_salt, real_queries=rq, real_hits=rh, sim_queries=sq,
            sim_hits=sh, ref_queries=exp.queries, ref_hits=exp.hits, real_ms=round(rms, 1),
            sim_ms=round(sms, 1) if sms is not None else None, real_usage_prompt_tokens=usage,
            match=(rq == sq and rh == sh) if sim_url is not None else None,
            ref_match=(rq == exp.queries and rh == exp.hits),
        )
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = (f"{'#':>3} {'phase':<6} {'tokens':>6} {'real q/h':>11} {'sim q/h':>11} "
          f"{'ref q/h':>11} {'match':<5} {'real ms':>8} {'sim ms':>7}  label")


def _qh(q: int | None, h: int | None) -> str:
    return "-" if q is None else f"{q}/{h}"


def format_row(r: Row) -> str:
    match = "-" if r.match is None else ("yes" if r.match else "NO")
    sim_ms = "-" if r.sim_ms is None else f"{r.sim_ms:.0f}"
    return (f"{r.index:>3} {r.phase:<6} {r.prompt_tokens:>6} {_qh(r.real_queries, r.real_hits):>11} "
            f"{_qh(r.sim_queries, r.sim_hits):>11} {_qh(r.ref_queries, r.ref_hits):>11} "
            f"{match:<5} {r.real_ms:>8.0f} {sim_ms:>7}  {r.label}")


def markdown_table(rows: list[Row], collapse_fill: bool = True) -> str:
    """The rows as a Markdown table; consecutive eviction-phase fill requests in one line."""
    out = ["| # | phase | prompt tokens | salt | real queries/hits | sim queries/hits | "
           "reference | match | request |",
           "|---:|---|---:|---|---:|---:|---:|---|---|"]
    i = 0
    while i < len(rows):
        r = rows[i]
        if collapse_fill and r.phase == "evict" and r.label.startswith("fill "):
            j = i
            while j + 1 < len(rows) and rows[j + 1].label.startswith("fill "):
                j += 1
            grp = rows[i:j + 1]
            same = all(g.match for g in grp)
            hits = sorted({g.real_hits for g in grp})
            out.append(
                f"| {r.index}-{rows[j].index} | evict | {r.prompt_tokens} each | | "
                f"{sum(g.real_queries for g in grp)}/{sum(g.real_hits for g in grp)} | "
                f"{sum(g.sim_queries or 0 for g in grp)}/{sum(g.sim_hits or 0 for g in grp)} | "
                f"{sum(g.ref_queries for g in grp)}/{sum(g.ref_hits for g in grp)} | "
                f"{'yes' if same else 'NO'} | {len(grp)} fresh fill prompts (hits per request: {hits}) |")
            i = j + 1
            continue
        match = "-" if r.match is None else ("yes" if r.match else "**NO**")
        out.append(f"| {r.index} | {r.phase} | {r.prompt_tokens} | {r.cache_salt or ''} | "
                   f"{_qh(r.real_queries, r.real_hits)} | {_qh(r.sim_queries, r.sim_hits)} | "
                   f"{_qh(r.ref_queries, r.ref_hits)} | {match} | {r.label} |")
        i += 1
    return "\n".join(out) + "\n"


def summarize(rows: list[Row], with_sim: bool, tail_ref: Trace | None = None) -> dict:
    """Per-phase counts. ``tail_ref``: the same trace's expectations under the simpler
    "every freed block to the queue tail" model, compared with the simulator."""
    out: dict = {}
    for phase in ("fit", "evict"):
        pr = [r for r in rows if r.phase == phase]
        if not pr:
            continue
        d: dict[str, Any] = {
            "requests": len(pr),
            "real_vs_ref_match": sum(r.ref_match for r in pr),
            "real_queries": sum(r.real_queries for r in pr),
            "real_hits": sum(r.real_hits for r in pr),
            "ref_hits": sum(r.ref_hits for r in pr),
        }
        if with_sim:
            d["real_vs_sim_match"] = sum(bool(r.match) for r in pr)
            d["sim_queries"] = sum(r.sim_queries or 0 for r in pr)
            d["sim_hits"] = sum(r.sim_hits or 0 for r in pr)
            d["mismatches"] = [r.index for r in pr if not r.match]
            if tail_ref is not None:
                d["sim_vs_tail_ref_match"] = sum(
                    r.sim_queries == tail_ref.expected[r.index].queries
                    and r.sim_hits == tail_ref.expected[r.index].hits for r in pr)
        out[phase] = d
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.fidelity",
                                description="real vLLM vs simulator: prefix-cache counters request by request")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="tiny model dir (made if missing)")
    p.add_argument("--requests", type=int, default=40, help="requests in the non-evicting phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--evict", action="store_true", help="append the eviction phase")
    p.add_argument("--num-gpu-blocks", type=int, default=512,
                   help="KV blocks for real vLLM (--num-gpu-blocks-override); 0: vLLM's own sizing")
    p.add_argument("--block-size", type=int, default=None, help="--block-size for real vLLM")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--vllm-port", type=int, default=8290)
    p.add_argument("--vllm-url", default=None, help="use this running vLLM instead of starting one")
    p.add_argument("--sim-python", default=None,
                   help="python for `-m extproc sim` (default: /work/main/.venv/bin/python or this one)")
    p.add_argument("--sim-port", type=int, default=8390)
    p.add_argument("--sim-url", default=None, help="use this running simulator instead of starting one")
    p.add_argument("--sim-time-scale", type=float, default=20.0,
                   help="simulator speed-up (simulated durations are divided by it)")
    p.add_argument("--no-sim", action="store_true", help="real vLLM vs the reference model only")
    p.add_argument("--json", default=None, help="write rows and summary to this file")
    p.add_argument("--markdown", default=None, help="write the table as Markdown to this file")
    a = p.parse_args(argv)

    fleet: VllmFleet | None = None
    sim: SimProcess | None = None
    info: dict = {}
    try:
        if a.vllm_url:
            real_url = a.vllm_url.rstrip("/")
            if not promtext.reset_prefix_cache(real_url):
                log(f"[fidelity] WARNING: POST {real_url}/reset_prefix_cache failed "
                    "(start vLLM with VLLM_SERVER_DEV_MODE=1); its cache is not fresh")
        else:
            model_dir = Path(a.model)
            log(f"[fidelity] tiny model in {model_dir}")
            ensure_tiny_model(model_dir, a.vllm_python)
            fleet = VllmFleet(model_dir, 1, a.vllm_port, a.vllm_python, block_size=a.block_size,
                              num_gpu_blocks=a.num_gpu_blocks or None,
                              max_num_batched_tokens=a.max_num_batched_tokens, dev_mode=True)
            fleet.start()
            real_url = fleet.urls[0]
            info["reset_prefix_cache_ok"] = fleet.reset_prefix_cache()[0]
            info["vllm_startup_s"] = round(fleet.startup_seconds[0], 1)
            info["vllm_rss_mb_ready"] = round(fleet.rss_mb(0))
        real_model = promtext.served_model(real_url)
        cc = promtext.cache_config(real_url)
        if not cc or "block_size" not in cc or "num_gpu_blocks" not in cc:
            raise RuntimeError(f"no vllm:cache_config_info with block_size/num_gpu_blocks: {cc}")
        block_size, num_blocks = int(cc["block_size"]), int(cc["num_gpu_blocks"])
        info.update({"block_size": block_size, "num_gpu_blocks": num_blocks,
                     "cache_config_info": cc})
        log(f"[fidelity] real vLLM {real_url}: block_size {block_size}, num_gpu_blocks {num_blocks}")

        vocab_high = 4096
        try:
            from routerlab.realvllm.tiny_model import model_info
            vocab_high = int(model_info(a.model)["tokenizer_vocab_size"])
        except (OSError, KeyError, ValueError):
            pass
        trace = build_trace(block_size=block_size, seed=a.seed, requests=a.requests,
                            num_blocks=num_blocks, evict=a.evict, vocab_high=vocab_high)
        tail_ref = build_trace(block_size=block_size, seed=a.seed, requests=a.requests,
                               num_blocks=num_blocks, evict=a.evict, vocab_high=vocab_high,
                               unhashed_to_front=False)

        sim_url = sim_model = None
        if not a.no_sim:
            if a.sim_url:
                sim_url = a.sim_url.rstrip("/")
            else:
                sim_python = a.sim_python or (
                    str(REPO_DIR / ".venv/bin/python") if (REPO_DIR / ".venv/bin/python").exists()
                    else sys.executable)
                sim = SimProcess(sim_python, a.sim_port, block_size, num_blocks,
                                 a.max_num_batched_tokens, a.sim_time_scale)
                sim_url = sim.start()
            sim_model = promtext.served_model(sim_url)
            if a.sim_url:
                promtext.reset_prefix_cache(sim_url)
            scc = promtext.cache_config(sim_url)
            info["sim_cache_config_info"] = scc
            log(f"[fidelity] simulator {sim_url}: cache_config_info {scc}")

        print(HEADER, flush=True)
        t0 = time.monotonic()
        rows = run_trace(trace, real_url, real_model, sim_url, sim_model)
        info["trace_seconds"] = round(time.monotonic() - t0, 1)
        if fleet is not None:
            info["vllm_rss_mb_after"] = round(fleet.rss_mb(0))
    finally:
        if sim is not None:
            sim.stop()
        if fleet is not None:
            fleet.stop()

    summary = summarize(rows, sim_url is not None, tail_ref)
    fit = summary.get("fit", {})
    print()
    for phase, d in summary.items():
        parts = [f"{phase}: {d['requests']} requests"]
        if "real_vs_sim_match" in d:
            parts.append(f"real==sim {d['real_vs_sim_match']}/{d['requests']}")
        parts.append(f"real==reference {d['real_vs_ref_match']}/{d['requests']}")
        if "sim_vs_tail_ref_match" in d:
            parts.append(f"sim==all-to-tail reference {d['sim_vs_tail_ref_match']}/{d['requests']}")
        parts.append(f"hit tokens real {d['real_hits']}" + (f" sim {d['sim_hits']}" if "sim_hits" in d else "")
                     + f" ref {d['ref_hits']} of {d['real_queries']} queried")
        print("; ".join(parts))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "seed": a.seed, "requests": a.requests, "evict": a.evict, "info": info,
            "summary": summary, "rows": [asdict(r) for r in rows],
        }, indent=2))
        log(f"[fidelity] wrote {a.json}")
    if a.markdown:
        Path(a.markdown).write_text(markdown_table(rows))
        log(f"[fidelity] wrote {a.markdown}")
    if sim_url is None:
        ok = fit.get("real_vs_ref_match") == fit.get("requests")
    else:
        ok = fit.get("real_vs_sim_match") == fit.get("requests")
    print("FIDELITY", "OK" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
