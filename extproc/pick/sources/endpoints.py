"""Where the replicas are: a static list, a file re-read when it changes, or a DNS name.

Each source yields ``ip:port`` strings, the hosts of the Envoy cluster the router picks
among (Envoy only honours a pick that is a member of the cluster). A bad line in the file
or a failed DNS lookup is logged and the last good list kept: discovery trouble must not
empty the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Sequence

from extproc.core.settings import ServerSettings, SettingError, host_address, parse_value

log = logging.getLogger("extproc.pick.sources.endpoints")

OnChange = Callable[[Sequence[str]], None]
FILE_POLL_SECONDS = 1.0


def parse_endpoint_lines(text: str, source: str) -> list[str]:
    """One ``ip:port`` per line or comma-separated; ``#`` starts a comment; bad entries skipped."""
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        for part in line.split("#", 1)[0].split(","):
            if not part.strip():
                continue
            try:
                out.extend(parse_value("endpoints", part, f"{source} line {n}"))
            except SettingError as exc:
                log.warning("ignoring endpoint: %s", exc)
    return list(dict.fromkeys(out))


class EndpointWatcher:
    """Runs the configured source in the background and reports each new list."""

    def __init__(self, cfg: ServerSettings, on_change: OnChange) -> None:
        self.cfg = cfg
        self.on_change = on_change
        self.current: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._mtime: tuple[float, int] | None = None

    def _publish(self, addresses: Sequence[str]) -> None:
        addresses = list(addresses)
        if addresses != self.current:
            log.info("endpoints: %s", ", ".join(addresses) or "(none)")
            self.current = addresses
            self.on_change(addresses)

    def read_file(self) -> None:
        """Re-read the endpoints file if it changed (mtime or size)."""
        path = self.cfg.endpoints_file
        try:
            st = os.stat(path)
            stamp = (st.st_mtime, st.st_size)
            if stamp == self._mtime:
                return
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            if self._mtime is not None or not self.current:
                log.warning("cannot read endpoints file %s: %s (keeping %d endpoints)", path, exc.strerror,
                            len(self.current))
            self._mtime = None
            return
        self._mtime = stamp
        self._publish(parse_endpoint_lines(text, path))

    async def resolve(self) -> None:
        name, _, port = self.cfg.endpoints_dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            log.warning("cannot resolve %s: %s (keeping %d endpoints)", self.cfg.endpoints_dns, exc,
                        len(self.current))
            return
        self._publish(sorted({host_address(str(info[4][0]), int(port)) for info in infos}))

    async def start(self) -> None:
        """Load the first list now (so pick mode serves from the first request), then watch."""
        if self.cfg.endpoints:
            self._publish(self.cfg.endpoints)
        elif self.cfg.endpoints_file:
            self.read_file()
            self._task = asyncio.get_running_loop().create_task(self._poll(self.read_file, FILE_POLL_SECONDS))
        elif self.cfg.endpoints_dns:
            await self.resolve()
            self._task = asyncio.get_running_loop().create_task(self._poll(self.resolve, self.cfg.dns_interval))

    async def _poll(self, step: Callable[[], object], every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("endpoint discovery step failed")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
