"""The replicas an arm routes to: a fresh simulated fleet, zero-work servers, or URLs.

Every arm gets a fresh fleet (cold caches, zeroed counters) when we start it; external
servers cannot be restarted, so between arms their prefix cache is reset with vLLM's
``POST /reset_prefix_cache`` (needs ``VLLM_SERVER_DEV_MODE=1``), best effort.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from routerlab.bench.scenarios import FleetSpec
from routerlab.harness.procs import Process, free_port_run, free_ports, python_module
from routerlab.realvllm.promtext import reset_prefix_cache

_READY = re.compile(r"replica (\d+) ready on (http://\S+)")


class Backend(Protocol):
    urls: list[str]

    @property
    def block_size(self) -> int: ...
    def start(self) -> Backend: ...
    def stop(self) -> None: ...
    def event_flags(self) -> list[str]: ...
    @property
    def pids(self) -> dict[str, int]: ...


def _ready_urls(proc: Process, n: int) -> list[str]:
    found: dict[int, str] = {}
    for line in list(proc.lines):
        m = _READY.search(line)
        if m:
            found[int(m.group(1))] = m.group(2)
    return [found[i] for i in range(n)] if len(found) >= n else []


class _ChildFleet:
    """A child process serving ``replicas`` loopback ports, each announced by a ready line."""

    name = "backend"
    urls: list[str]
    process: Process | None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def count(self) -> int:
        raise NotImplementedError

    def event_flags(self) -> list[str]:
        """Router flags this fleet asks of precise arms (none: it publishes no KV-cache events)."""
        return []

    def start(self) -> _ChildFleet:
        self.process = proc = Process(self.argv(), name=self.name)
        proc.wait_ready(lambda: bool(_ready_urls(proc, self.count())), timeout=60)
        self.urls = _ready_urls(proc, self.count())
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop()

    @property
    def pids(self) -> dict[str, int]:
        return {self.name: self.process.pid} if self.process else {}


@dataclass
class SimBackend(_ChildFleet):
    """``prefix-router sim`` in a child process, on ephemeral loopback ports."""

    spec: FleetSpec
    urls: list[str] = field(default_factory=list)
    process: Process | None = None
    base_port: int = 0  # 0: ephemeral ports; else replica i on base_port + i (a restart keeps the port)
    name = "sim"

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def count(self) -> int:
        return self.spec.replicas

    def start(self) -> SimBackend:
        if self.spec.kv_events and not self.base_port:
            # replica i on base + i, its events on base + n + i, its replay socket on base + 2n + i:
            # the router finds them at fixed offsets from each replica's port (--kv-ports-relative)
            self.base_port = free_port_run(3 * self.spec.replicas)
        super().start()
        return self

    def event_flags(self) -> list[str]:
        """What a precise-mode router needs to read this fleet's events (none without events)."""
        s, n = self.spec, self.spec.replicas
        if not s.kv_events:
            return []
        return ["--kv-events", "on", "--tokenizer", str(s.tokenizer), "--kv-ports-relative", "on",
                "--kv-events-port", str(n), "--kv-replay-port", str(2 * n)]

    def argv(self) -> list[str]:
        s = self.spec
        argv = python_module("extproc", "sim", "--replicas", str(s.replicas), "--base-port", str(self.base_port),
                             "--profile", s.profile, "--time-scale", str(s.time_scale),
                             "--block-size", str(s.block_size))
        for flag, value in (("--num-blocks", s.num_blocks), ("--max-num-seqs", s.max_num_seqs),
                            ("--max-num-batched-tokens", s.max_num_batched_tokens), ("--tokenizer", s.tokenizer),
                            ("--scheduling-policy", s.scheduling_policy)):
            if value is not None:
                argv += [flag, str(value)]
        if s.kv_events:
            argv += ["--kv-events-port-offset", str(s.replicas), "--kv-replay-port-offset", str(2 * s.replicas),
                     "--kv-events-buffer-steps", str(s.kv_buffer_steps)]
        for model, count, profile in s.pools:
            argv += ["--pool", f"{model}={count}:{profile}"]
        if s.lora_adapters:  # vLLM's flags: every replica serves every adapter
            argv += ["--enable-lora", "--max-loras", str(s.max_loras or 1),
                     *(("--max-cpu-loras", str(s.max_cpu_loras)) if s.max_cpu_loras else ()),
                     "--lora-modules", *(f"{name}=/adapters/{name}" for name in s.lora_adapters)]
        return argv


@dataclass
class ZeroBackend(_ChildFleet):
    """Zero-work servers (the overhead scenario); with ``announce``, each also publishes KV-cache
    events announcing the prompts in that file (routerlab.bench.zero_events), for precise mode."""

    replicas: int
    urls: list[str] = field(default_factory=list)
    process: Process | None = None
    block_size: int = 16
    announce: Path | None = None  # zero_events.write_announcement's file
    tokenizer: str = ""  # the router's --tokenizer for the announced prompts (NAME=DIR)
    name = "backend"

    def count(self) -> int:
        return self.replicas

    def event_flags(self) -> list[str]:
        """What a precise-mode router needs to read this fleet's events (none without them)."""
        n = self.replicas
        if self.announce is None:
            return []
        # no run-time tokenizer checks: a zero backend has no POST /tokenize to check against
        return ["--kv-events", "on", "--tokenizer", self.tokenizer, "--kv-ports-relative", "on",
                "--kv-events-port", str(n), "--kv-replay-port", str(2 * n), "--tokenizer-check-every", "0"]

    def argv(self) -> list[str]:
        n = self.replicas
        if self.announce is None:
            return python_module("routerlab.bench.zero_backend", "--ports", ",".join(map(str, free_ports(n))))
        base = free_port_run(3 * n)  # replica i on base + i, its events on base + n + i, replay on base + 2n + i
        return python_module("routerlab.bench.zero_backend", "--ports", ",".join(str(base + i) for i in range(n)),
                             "--announce", str(self.announce), "--kv-events-port-offset", str(n),
                             "--kv-replay-port-offset", str(2 * n))


@dataclass
class ExternalBackend:
    """Servers someone else runs (``--backend-url``); caches are reset between arms."""

    urls: list[str]
    block_size: int = 16
    reset_ok: bool | None = None

    def start(self) -> ExternalBackend:
        self.reset_ok = all(reset_prefix_cache(u) for u in self.urls)
        return self

    def event_flags(self) -> list[str]:
        return []  # --backend-url gives no event ports: precise arms need the simulated fleet

    def stop(self) -> None:
        pass

    @property
    def pids(self) -> dict[str, int]:
        return {}
