"""Which optional extra a subcommand needs, checked before it runs.

A production install (`pip install envoy-prefix-router`) carries only what `serve` needs; the
simulator and the benchmark sit behind extras. Reading the extras from the installed package's
own metadata keeps pyproject.toml the one list of what each extra holds.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable

DIST = "envoy-prefix-router"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_SELF_EXTRAS = re.compile(r"\[([^\]]+)\]")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def requirements(extra: str, requires: list[str]) -> list[str]:
    """Distribution names ``extra`` pulls in, following extras that name this package again."""
    names: list[str] = []
    for req in requires:
        marker = _EXTRA.search(req)
        if marker is None or marker.group(1) != extra:
            continue
        name = _NAME.match(req)
        if name is None:
            continue
        if re.sub(r"[-_.]+", "-", name.group(0)).lower() == DIST:  # PEP 503: envoy_prefix_router is us too
            included = _SELF_EXTRAS.search(req)
            for inner in (included.group(1).split(",") if included else []):
                names += requirements(inner.strip(), requires)
        else:
            names.append(name.group(0))
    return names


def missing(extra: str, installed: Callable[[str], bool] | None = None,
            requires: list[str] | None = None) -> list[str]:
    """Distributions of ``extra`` that are not installed ([] when run from a bare source tree)."""
    installed = installed or _installed
    if requires is None:
        try:
            requires = importlib.metadata.requires(DIST) or []
        except importlib.metadata.PackageNotFoundError:
            return []
    return [name for name in requirements(extra, requires) if not installed(name)]


def install_hint(command: str, extra: str, absent: list[str]) -> str:
    """The one line a user sees instead of a traceback."""
    return (f"prefix-router {command} needs the [{extra}] extra (missing: {', '.join(sorted(absent))}): "
            f"pip install '{DIST}[{extra}]'")
