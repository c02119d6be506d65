"""Progress while a benchmark runs: a rich bar on a terminal, a line per step otherwise."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Protocol

from routerlab.bench.loadgen import Result

if TYPE_CHECKING:
    from rich.progress import TaskID


class Progress(Protocol):
    def note(self, text: str) -> None: ...
    def start(self, label: str, total: int) -> None: ...
    def advance(self, result: Result) -> None: ...
    def finish(self, text: str) -> None: ...


class Quiet:
    """For tests and the Python API."""

    def note(self, text: str) -> None:
        pass

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, result: Result) -> None:
        pass

    def finish(self, text: str) -> None:
        pass


class Lines:
    """A line per step and one every ~10 % of requests (logs, CI, pipes)."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.total = self.done = self.failed = 0
        self.label = ""
        self.t0 = time.monotonic()
        self.next_mark = 0

    def note(self, text: str) -> None:
        print(f"[bench] {text}", file=self.stream, flush=True)

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.t0 = time.monotonic()
        self.next_mark = max(1, total // 10)
        self.note(f"{label}: sending {total} requests")

    def advance(self, result: Result) -> None:
        self.done += 1
        self.failed += not result.ok
        if self.done >= self.next_mark:
            self.next_mark += max(1, self.total // 10)
            self.note(f"{self.label}: {self.done}/{self.total} done, {self.failed} failed, "
                      f"{time.monotonic() - self.t0:.0f}s")

    def finish(self, text: str) -> None:
        self.note(text)


class Bar:
    """A rich progress bar per arm on an interactive terminal."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.console = Console(stderr=True)
        self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                                console=self.console, transient=False)
        self.task: TaskID | None = None
        self.failed = 0

    def note(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/dim]")

    def start(self, label: str, total: int) -> None:
        self.failed = 0
        if not self.bar.live.is_started:
            self.bar.start()
        self.task = self.bar.add_task(label, total=total, failed=0)

    def advance(self, result: Result) -> None:
        self.failed += not result.ok
        if self.task is not None:
            self.bar.update(self.task, advance=1, failed=self.failed)

    def finish(self, text: str) -> None:
        if self.task is not None:
            self.bar.update(self.task, description=text)
            self.task = None


def stop(progress: Progress) -> None:
    if isinstance(progress, Bar) and progress.bar.live.is_started:
        progress.bar.stop()


def default() -> Progress:
    return Bar() if sys.stderr.isatty() else Lines()
