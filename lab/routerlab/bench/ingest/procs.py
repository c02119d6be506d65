"""The processes of an ingest run: zero-work replicas, the event driver and the precise-mode router.

Ports: replica i serves HTTP on ``base + i`` (a zero backend: /metrics for the router's scraper),
publishes its events on ``base + n + i`` and its replay socket on ``base + 2n + i``; the router
reads them with ``--kv-ports-relative on --kv-events-port n --kv-replay-port 2n``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from routerlab.bench.zero_backend import MODEL
from routerlab.harness.procs import Process, free_port_run, free_ports, python_module

READY_TIMEOUT_S = 120.0  # building 64 replicas' cycles takes a few seconds on a loaded machine


class DriverProc:
    """``routerlab.bench.ingest.driver`` as a child: one command a line in, one JSON line out."""

    def __init__(self, base: int, replicas: int, hot: Path, capacity: int, step_blocks: int, seed: int,
                 log: Path) -> None:
        argv = python_module("routerlab.bench.ingest.driver", "--base-port", str(base), "--replicas", str(replicas),
                             "--events-offset", str(replicas), "--replay-offset", str(2 * replicas),
                             "--hot", str(hot), "--capacity", str(capacity), "--step-blocks", str(step_blocks),
                             "--seed", str(seed))
        self._log = log.open("w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self.ready = self._line(READY_TIMEOUT_S)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise TimeoutError(f"event driver silent for {timeout:.0f}s (log: {self._log.name})")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"event driver exited with {self.proc.poll()} (log: {self._log.name})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, command: str, timeout: float = 10.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def rate(self, blocks_per_s: float) -> None:
        self.ask(f"rate {blocks_per_s}")

    def stats(self) -> dict[str, Any]:
        return self.ask("stats")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit", timeout=2.0)
            except (OSError, TimeoutError, RuntimeError, ValueError):
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def replicas_argv(base: int, n: int) -> list[str]:
    return python_module("routerlab.bench.zero_backend", "--ports", ",".join(str(base + i) for i in range(n)))


def router_argv(base: int, n: int, tokenizer: Path, port: int, metrics_port: int) -> list[str]:
    """``prefix-router serve`` in precise mode over the n replicas (no tokenizer checks: a zero
    backend has no POST /tokenize)."""
    endpoints = ",".join(f"127.0.0.1:{base + i}" for i in range(n))
    return python_module("extproc", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
                         "--log-level", "warning", "--drain-seconds", "1", "--endpoints", endpoints,
                         "--kv-events", "on", "--tokenizer", f"{MODEL}={tokenizer}", "--kv-ports-relative", "on",
                         "--kv-events-port", str(n), "--kv-replay-port", str(2 * n), "--tokenizer-check-every", "0")


def start_replicas(n: int) -> tuple[int, Process]:
    """n zero backends on base..base+n-1 (with 2n more free ports above them for the events)."""
    base = free_port_run(3 * n)
    proc = Process(replicas_argv(base, n), name="zero replicas")
    proc.wait_ready(lambda: sum("ready on" in line for line in list(proc.lines)) >= n, timeout=60)
    return base, proc


def start_router(base: int, n: int, tokenizer: Path) -> tuple[Process, int, int]:
    port, metrics_port = free_ports(2)
    proc = Process(router_argv(base, n, tokenizer, port, metrics_port), name="prefix-router")
    proc.wait_for_line("ready on", timeout=60)
    return proc, port, metrics_port

