"""Which optional extra a subcommand needs, checked before it runs.

The lab's heavier commands (bench, demo) sit behind its ``[bench]`` extra. Reading the extras
from the installed distribution's own metadata keeps its pyproject.toml the one list of what
each extra holds.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_SELF_EXTRAS = re.compile(r"\[([^\]]+)\]")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def requirements(dist: str, extra: str, requires: list[str]) -> list[str]:
    """Distribution names ``extra`` of ``dist`` pulls in, following extras that name ``dist`` again."""
    names: list[str] = []
    for req in requires:
        marker = _EXTRA.search(req)
        if marker is None or marker.group(1) != extra:
            continue
        name = _NAME.match(req)
        if name is None:
            continue
        if _canonical(name.group(0)) == _canonical(dist):
            included = _SELF_EXTRAS.search(req)
            for inner in (included.group(1).split(",") if included else []):
                names += requirements(dist, inner.strip(), requires)
        else:
            names.append(name.group(0))
    return names


def missing(extra: str, dist: str, installed: Callable[[str], bool] | None = None,
            requires: list[str] | None = None) -> list[str]:
    """Distributions of ``dist[extra]`` that are not installed ([] when ``dist`` is not installed)."""
    installed = installed or _installed
    if requires is None:
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            return []
    return [name for name in requirements(dist, extra, requires) if not installed(name)]


def install_hint(command: str, dist: str, extra: str, absent: list[str]) -> str:
    """The one line a user sees instead of a traceback."""
    return (f"prefix-router {command} needs the [{extra}] extra (missing: {', '.join(sorted(absent))}): "
            f"pip install '{dist}[{extra}]'")
