"""CI-sized tests for routerlab.realvllm: no vLLM, no torch.

Real vLLM (3 GB) is not run here; docs/fidelity.md has the result of the real comparison.
What runs: the token-id trace and its reference prefix-cache model, the Prometheus parser,
the launcher's start / health-wait / stop-by-PID logic against a stand-in server module,
and the lazy imports of the tiny-model maker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from routerlab.harness.procs import free_port_run
from routerlab.realvllm import promtext
from routerlab.realvllm.fidelity import Row, SimProcess, format_row, markdown_table, summarize
from routerlab.realvllm.launcher import VllmFleet, VllmStartError, _port_free
from routerlab.realvllm.trace import ReferenceCache, build_trace

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- trace
def _by_label(trace, text):
    hits = [i for i, r in enumerate(trace.requests) if r.label == text]
    assert hits, text
    return hits[0]


def test_trace_is_deterministic_per_seed():
    a = build_trace(block_size=16, seed=7, requests=50, num_blocks=600, evict=True)
    b = build_trace(block_size=16, seed=7, requests=50, num_blocks=600, evict=True)
    c = build_trace(block_size=16, seed=8, requests=50, num_blocks=600, evict=True)
    assert [(r.prompt, r.cache_salt, r.label) for r in a.requests] == \
        [(r.prompt, r.cache_salt, r.label) for r in b.requests]
    assert [(e.queries, e.hits) for e in a.expected] == [(e.queries, e.hits) for e in b.expected]
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]


@pytest.mark.parametrize("block_size", [16, 128])
def test_trace_fit_phase_has_the_claimed_cases(block_size):
    B = block_size
    t = build_trace(block_size=B, seed=0, requests=40, num_blocks=512)
    fit = [i for i in t.phase("fit")]
    assert len(fit) == 40 and not t.phase("evict")
    exp = t.expected
    reqs = t.requests
    # tokens inside the vocabulary, below the special ids, prompts fit the context
    for r in reqs:
        assert all(16 <= tok < 4096 for tok in r.prompt)
        assert 1 <= len(r.prompt) < 8192
    # queries are always the prompt length
    assert all(e.queries == len(r.prompt) for r, e in zip(reqs, exp))
    cold = _by_label(t, f"cold doc A (3 blocks + {max(1, 37 * B // 128)})")
    assert exp[cold].hits == 0
    # repeat: every full block hits
    rep = _by_label(t, "repeat A")
    assert exp[rep].hits == 3 * B and len(reqs[rep].prompt) % B != 0  # partial-block tail
    # exact multiple of the block size: the hit is capped at len - 1, i.e. one block less
    cap = _by_label(t, "A[:2B], exact block multiple (hit capped at len-1)")
    assert len(reqs[cap].prompt) == 2 * B and exp[cap].hits == B
    assert exp[_by_label(t, "P again (capped: no hit)")].hits == 0
    assert exp[_by_label(t, "P + 1 token")].hits == B
    # a different cache_salt isolates the whole chain; the same salt hits again
    s1 = _by_label(t, "A with cache_salt tenant-b")
    s2 = _by_label(t, "A with cache_salt tenant-b again")
    assert reqs[s1].prompt == reqs[cold].prompt and reqs[s1].cache_salt == "tenant-b"
    assert exp[s1].hits == 0 and exp[s2].hits == 3 * B
    # a change in the first block kills the chain; one in block 2 keeps block 1
    assert exp[_by_label(t, "A with its first token changed")].hits == 0
    assert exp[_by_label(t, "A with a token in block 2 changed")].hits == B
    # shorter than a block never hits
    short = _by_label(t, "short prompt again")
    assert len(reqs[short].prompt) < B and exp[short].hits == 0
    # a mix of outcomes in the random part: full misses, partial and prefix hits
    rnd = [i for i in fit if reqs[i].label.startswith("random")]
    assert any(exp[i].hits == 0 for i in rnd) and any(exp[i].hits > 0 for i in rnd)
    assert any(reqs[i].cache_salt for i in rnd)
    # nothing is evicted in the fit phase
    assert all(exp[i].evicted == 0 for i in fit)
    assert all(e.hits % B == 0 and e.hits < e.queries for e in exp)


def test_fit_phase_refuses_a_cache_too_small():
    with pytest.raises(ValueError, match="evicts"):
        build_trace(block_size=16, seed=0, requests=40, num_blocks=20)


def test_evict_phase_evicts_and_gives_partial_hits():
    B = 128
    t = build_trace(block_size=B, seed=0, requests=40, num_blocks=512, evict=True)
    ev = t.phase("evict")
    assert ev and ev[0] == 40
    exp, reqs = t.expected, t.requests
    assert sum(exp[i].evicted for i in ev) > 0
    after = [i for i in ev if "after the flood" in reqs[i].label]
    full = [i for i in after if exp[i].hits == (len(reqs[i].prompt) - 1) // B * B]
    none = [i for i in after if exp[i].hits == 0]
    partial = [i for i in after if 0 < exp[i].hits < (len(reqs[i].prompt) - 1) // B * B]
    assert full and none and partial, (full, none, partial)
    # the last use before the flood survives it
    v = _by_label(t, "V again after the flood")
    assert exp[v].hits == 4 * B


def test_evict_phase_prompts_do_not_depend_on_the_reference_variant():
    a = build_trace(block_size=128, seed=0, requests=40, num_blocks=512, evict=True)
    b = build_trace(block_size=128, seed=0, requests=40, num_blocks=512, evict=True,
                    unhashed_to_front=False)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    # ... but the two cache models disagree after the flood (the documented difference)
    assert [e.hits for e in a.expected] != [e.hits for e in b.expected]
    fit = a.phase("fit")
    assert [a.expected[i].hits for i in fit] == [b.expected[i].hits for i in fit]


# --------------------------------------------------------------------------- reference
def test_reference_cache_basics():
    c = ReferenceCache(block_size=4, num_blocks=100)
    p = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    assert c.run(p, None).hits == 0
    assert c.run(p, None).hits == 8
    assert c.run(p[:8], None).hits == 4  # capped at len - 1
    assert c.run(p, "s").hits == 0  # salt isolates
    assert c.run(p, "s").hits == 8
    assert c.run([99] + p[1:], None).hits == 0  # parent hash chains


def test_reference_cache_evicts_lru_tail_first():
    # 1 null block + 6 usable blocks of 2 tokens
    c = ReferenceCache(block_size=2, num_blocks=7)
    a = [1, 2, 3, 4, 5, 6]          # 3 full blocks
    b = [11, 12, 13, 14, 15, 16]    # 3 full blocks
    c.run(a, None)
    c.run(b, None)
    # queue (head first): a3 a2 a1 b3 b2 b1 -- a fresh 1-block prompt evicts a's tail
    e = c.run([21, 22, 23], None)  # 2 blocks: 1 full + 1 partial
    assert e.evicted == 2
    assert c.lookup(a + [0], None) == 1  # a's head block survived
    assert c.lookup(b + [0], None) == 3


def test_reference_cache_unhashed_blocks_go_to_the_front():
    # vLLM 0.32: the partial block of a finished request is reused first.
    for front, evicted in ((True, 0), (False, 1)):
        c = ReferenceCache(block_size=2, num_blocks=5, unhashed_to_front=front)
        c.run([1, 2, 3], None)      # block A (hashed) + partial P; 2 never-used blocks left
        c.run([7, 8, 9], None)      # B (hashed) + partial: takes never-used / P
        e = c.run([4, 5, 6], None)  # needs 2 blocks
        assert e.evicted == evicted, front
        assert c.lookup([1, 2, 0], None) == (1 if front else 0)


# --------------------------------------------------------------------------- prometheus
METRICS = textwrap.dedent('''\
    # HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
    # TYPE vllm:prefix_cache_queries_total counter
    vllm:prefix_cache_queries_total{engine="0",model_name="m"} 421.0
    vllm:prefix_cache_hits_total{engine="0",model_name="m"} 384.0
    vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0
    vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="512",note="a \\"q\\""} 1.0
    vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
    ''')


def test_parse_prometheus():
    s = promtext.parse_prometheus(METRICS)
    assert promtext.metric_sum(s, promtext.QUERIES) == 421.0
    assert promtext.metric_sum(s, promtext.HITS) == 400.0
    cc = promtext.metric_labels(s, promtext.CACHE_CONFIG)
    assert cc["block_size"] == "128" and cc["num_gpu_blocks"] == "512" and cc["note"] == 'a "q"'
    assert promtext.metric_sum(s, "vllm:time_to_first_token_seconds_bucket") == 3.0
    assert promtext.metric_labels(s, "absent") is None


# --------------------------------------------------------------------------- launcher
FAKE_SERVER = textwrap.dedent('''\
    """Stand-in for vllm.entrypoints.openai.api_server: /health after a delay, /metrics."""
    import argparse, http.server, os, time
    p = argparse.ArgumentParser()
    p.add_argument("--model"); p.add_argument("--host"); p.add_argument("--port", type=int)
    p.add_argument("--block-size", default="128"); p.add_argument("--num-gpu-blocks-override", default="99")
    a, _ = p.parse_known_args()
    with open(os.environ["FAKE_VLLM_ENVLOG"] + "." + str(a.port), "w") as f:
        f.write(os.environ["VLLM_CPU_OMP_THREADS_BIND"] + " " + os.environ["HF_HUB_OFFLINE"]
                + " " + os.environ["VLLM_CACHE_ROOT"])
    if os.environ.get("FAKE_VLLM_CRASH"):
        raise SystemExit(3)
    time.sleep(1.5)
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *x): pass
        def do_GET(self):
            body = b""
            if self.path == "/metrics":
                body = ('vllm:cache_config_info{block_size="%s",num_gpu_blocks="%s"} 1.0\\n'
                        % (a.block_size, a.num_gpu_blocks_override)).encode()
            elif self.path != "/health":
                self.send_response(404); self.end_headers(); return
            self.send_response(200); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
    http.server.HTTPServer((a.host, a.port), H).serve_forever()
    ''')


@pytest.fixture
def fake_vllm(tmp_path):
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "fake" / "vllm", tmp_path / "fake" / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_SERVER)
    return tmp_path


def test_launcher_command_and_environment(tmp_path):
    f = VllmFleet(tmp_path, replicas=3, base_port=9100, python=sys.executable, block_size=64,
                  num_gpu_blocks=64, max_num_batched_tokens=2048, workdir=tmp_path / "w",
                  dev_mode=True)
    assert f.urls == ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    cmd = f.command(1)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in cmd
    for flag, val in (("--port", "9101"), ("--host", "127.0.0.1"), ("--block-size", "64"),
                      ("--num-gpu-blocks-override", "64"), ("--max-num-batched-tokens", "2048")):
        assert cmd[cmd.index(flag) + 1] == val
    ncpu = os.cpu_count() or 1
    envs = [f.environment(i) for i in range(3)]
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == [str(i % ncpu) for i in range(3)]
    e = envs[2]
    assert e["HF_HUB_OFFLINE"] == "1" and e["VLLM_SERVER_DEV_MODE"] == "1"
    for k in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "HF_HOME"):
        assert e[k].startswith(str(tmp_path / "w"))
    assert len({e["VLLM_CACHE_ROOT"] for e in envs}) == 3
    with pytest.raises(ValueError):
        VllmFleet(tmp_path, host="0.0.0.0")
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmFleet(tmp_path, block_size=16)


def test_launcher_starts_waits_and_stops_by_pid(fake_vllm):
    base = free_port_run(2)
    lines: list[str] = []
    fleet = VllmFleet(
        fake_vllm, replicas=2, base_port=base, python=sys.executable, block_size=32,
        num_gpu_blocks=77, startup_timeout=30, progress=lines.append,
        extra_env={"PYTHONPATH": str(fake_vllm / "fake"),
                   "FAKE_VLLM_ENVLOG": str(fake_vllm / "env")},
    )
    with fleet:
        assert len(fleet.pids) == 2
        for i, u in enumerate(fleet.urls):
            assert promtext.http_get(u + "/health")[0] == 200
            cc = fleet.cache_config(i)
            assert cc == {"block_size": "32", "num_gpu_blocks": "77"}
        assert all(s >= 1.0 for s in fleet.startup_seconds)
        pids = fleet.pids
        workdir = fleet.workdir
        assert workdir is not None and workdir.exists()
        env0 = (fake_vllm / f"env.{base}").read_text().split()
        assert env0[1] == "1" and env0[2].startswith(str(workdir))
    assert any("healthy" in s for s in lines)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    assert all(_port_free("127.0.0.1", base + i) for i in range(2))
    assert not workdir.exists()  # own temp dir removed


def test_launcher_reports_a_crashed_server(fake_vllm):
    base = free_port_run(1)
    fleet = VllmFleet(
        fake_vllm, replicas=1, base_port=base, python=sys.executable, startup_timeout=20,
        progress=lambda s: None,
        extra_env={"PYTHONPATH": str(fake_vllm / "fake"), "FAKE_VLLM_CRASH": "1",
                   "FAKE_VLLM_ENVLOG": str(fake_vllm / "env")},
    )
    with pytest.raises(VllmStartError, match="exited with 3"):
        fleet.start()
    assert fleet.procs == []


# --------------------------------------------------------------------------- misc
def test_tiny_model_module_imports_without_torch():
    code = ("import sys, routerlab.realvllm.tiny_model as t, routerlab.realvllm.fidelity, "
            "routerlab.realvllm.launcher; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
            "c = t.generate_corpus(3, 50); assert c == t.generate_corpus(3, 50) != t.generate_corpus(4, 50); "
            "import tempfile; assert not t.is_complete(tempfile.mkdtemp()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_summary_and_row_format():
    rows = [
        Row(0, "fit", "a", 10, None, 10, 0, 10, 0, 10, 0, 5.0, 1.0, 10, True, True),
        Row(1, "fit", "b", 10, None, 10, 8, 10, 8, 10, 8, 5.0, 1.0, 10, True, True),
        Row(2, "evict", "c", 10, "s", 10, 8, 10, 0, 10, 8, 5.0, 1.0, 10, False, True),
    ]
    s = summarize(rows, with_sim=True)
    assert s["fit"]["real_vs_sim_match"] == 2 and s["evict"]["mismatches"] == [2]
    assert s["fit"]["real_hits"] == 8 and s["evict"]["sim_hits"] == 0
    line = format_row(rows[2])
    assert "10/8" in line and "10/0" in line and "NO" in line


def test_markdown_table_collapses_fill_rows():
    rows = [
        Row(0, "evict", "victim V", 10, None, 10, 0, 10, 0, 10, 0, 5.0, 1.0, 10, True, True),
        Row(1, "evict", "fill 1 (fresh)", 20, None, 20, 0, 20, 0, 20, 0, 5.0, 1.0, 20, True, True),
        Row(2, "evict", "fill 2 (fresh)", 20, None, 20, 4, 20, 4, 20, 4, 5.0, 1.0, 20, True, True),
        Row(3, "evict", "V again", 10, "s", 10, 8, 10, 0, 10, 8, 5.0, 1.0, 10, False, True),
    ]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 2 + 3  # header, rule, V, the two fills in one line, V again
    assert lines[3].startswith("| 1-2 | evict | 20 each |")
    assert "40/4 | 40/4 | 40/4 | yes" in lines[3]
    assert "hits per request: [0, 4]" in lines[3]
    assert lines[4].startswith("| 3 | evict | 10 | s | 10/8 | 10/0 | 10/8 | **NO** |")


def test_sim_process_does_not_leak_its_log_fd():
    before = len(os.listdir("/proc/self/fd"))
    procs = [SimProcess(sys.executable, 1, 32, 64, 2048, 1.0) for _ in range(5)]
    assert len(os.listdir("/proc/self/fd")) == before
    for sp in procs:
        assert sp.logfile.exists()
        sp.logfile.unlink()
