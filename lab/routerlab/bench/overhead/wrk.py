"""Driving wrk: the Lua script that sends chat bodies of a size, each with its own id, its
command line, and one run read back as wrk's JSON summary plus its CPU."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import orjson

from routerlab.bench.micro.bodies import chat_body

MARKER = "@@REQUEST-ID@@"


_LUA = """-- wrk: POST chat-completions bodies of {size} bytes, each with its own id (run-thread-n); with new_every > 0,
-- every new_every-th request takes the second template (its id starts the system prompt: all new)
local head = [==[{head}]==]
local tail = [==[{tail}]==]
local headers = {{["Content-Type"] = "application/json"}}
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local run, n = "0", 0
function init(args)
  run = args[1] or "0"
end
local new_head = [==[{new_head}]==]
local new_tail = [==[{new_tail}]==]
local new_every = {new_every}
function request()
  n = n + 1
  local id = run .. "-" .. tid .. "-" .. n
  if new_every > 0 and n % new_every == 0 then
    return wrk.format("POST", "/v1/chat/completions", headers, new_head .. id .. new_tail)
  end
  return wrk.format("POST", "/v1/chat/completions", headers, head .. id .. tail)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK_JSON {{"requests": %d, "duration_us": %d, "errors": {{"connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d}}, "latency_us": {{"p50": %d, "p90": %d, "p99": %d, "mean": %.1f, ' ..
    '"max": %d}}}}\\n', summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""


ID_AT = ("start", "end", "mixed")
MIXED_NEW_EVERY = 10  # id_at=mixed: one request in this many is all new (id_at=start), the others id_at=end


def body_template(size_kb: int, id_at: str = "start") -> tuple[bytes, bytes]:
    """The bytes before and after the per-request id of a ``size_kb`` KB chat body.

    ``start``: the id starts the system prompt, so no two requests share a prefix (the worst
    case for the router's index); ``end``: it ends the user message, so every request shares
    all but its end with every other (a cached system prompt; every request then has the same
    hash-mode key). ``mixed`` is two templates (``lua_script``); here it is the shared one, ``end``."""
    if id_at == "mixed":
        id_at = "end"
    if id_at == "start":
        body = chat_body(size_kb * 1024, size_kb, marker=MARKER, model="zero")
    elif id_at == "end":
        doc = json.loads(chat_body(size_kb * 1024, size_kb, model="zero"))
        doc["messages"][-1]["content"] += " " + MARKER
        body = json.dumps(doc).encode()
    else:
        raise ValueError(f"id_at must be one of {', '.join(ID_AT)}, got {id_at!r}")
    head, _, tail = body.partition(MARKER.encode())
    return head, tail


def lua_script(size_kb: int, id_at: str = "start") -> str:
    """The wrk script; with ``id_at="mixed"`` one request in ``MIXED_NEW_EVERY`` is all new (the
    ``start`` template) and the others share the system prompt (``end``)."""
    head, tail = body_template(size_kb, id_at)
    new_head, new_tail = body_template(size_kb, "start") if id_at == "mixed" else (b"", b"")
    if b"]==]" in head + tail + new_head + new_tail:
        raise ValueError("body text would end the Lua long string")
    return _LUA.format(size=len(head) + len(tail), head=head.decode(), tail=tail.decode(), new_head=new_head.decode(),
                       new_tail=new_tail.decode(), new_every=MIXED_NEW_EVERY if id_at == "mixed" else 0)


def wrk_argv(binary: str, url: str, script: Path, connections: int, threads: int, seconds: int,
             run_id: str) -> list[str]:
    return [binary, f"-t{max(1, min(threads, connections))}", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s",
            "-s", str(script), url, "--", run_id]


def run_wrk(argv: list[str], seconds: int) -> dict[str, Any]:
    """Run wrk to the end; its own JSON summary plus its CPU seconds (from its rusage)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(seconds + 60, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        watchdog.cancel()
    line = next((text for text in out.splitlines() if text.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}")
    result = orjson.loads(line.removeprefix("WRK_JSON "))
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    return result
