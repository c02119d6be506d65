"""One source of truth for settings: defaults, flags, env vars and per-stream metadata.

Every setting has one spec (parser + allowed values). The same spec checks a CLI flag
(``--prefix-length``), an environment variable (``PREFIX_ROUTER_PREFIX_LENGTH``) and, for
routing settings, the gRPC metadata key envoy.yaml sets per listener or per route
(``x-prefix-router-prefix-length``). Start-up errors are fatal and name the setting;
metadata errors are reported to the caller, which logs them and keeps the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from extproc.normalize import MODES

ENV_PREFIX: Final = "PREFIX_ROUTER_"
METADATA_PREFIX: Final = "x-prefix-router-"
DEFAULT_TENANT_HEADERS: Final = ("x-prefix-aware-id", "x-amzn-sagemaker-prefix-aware-id")
PREFIX_LENGTH_RANGE: Final = (64, 65536)
_HEADER_NAME = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")


class SettingError(ValueError):
    """A setting value outside what is allowed; the message names the setting."""


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """What decides a request's key; overridable per stream by envoy.yaml metadata."""

    prefix_length: int = 4096
    normalize: str = "prompt"
    key_header: str = "x-prefix-key"
    tenant_headers: tuple[str, ...] = DEFAULT_TENANT_HEADERS


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Process-wide settings of ``prefix-router serve``."""

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9464
    drain_seconds: float = 10.0
    log_level: str = "INFO"
    metadata_namespace: str = "prefix_router"


@dataclass(frozen=True, slots=True)
class _Spec:
    parse: Callable[[str], Any]
    allowed: str


def _number_in(kind: Callable[[str], Any], lo: float, hi: float) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        value = kind(raw.strip())
        if not lo <= value <= hi:
            raise ValueError
        return value
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError
        return value
    return parse


def _header_name(raw: str) -> str:
    value = raw.strip().lower()
    if not _HEADER_NAME.match(value):
        raise ValueError
    return value


def _header_list(raw: str) -> tuple[str, ...]:
    names = tuple(_header_name(part) for part in raw.split(",") if part.strip())
    if not names:
        raise ValueError
    return names


def _non_empty(raw: str) -> str:
    if not raw.strip():
        raise ValueError
    return raw.strip()


SPECS: Final[dict[str, _Spec]] = {
    "prefix_length": _Spec(_number_in(int, *PREFIX_LENGTH_RANGE), "an integer in 64..65536 (bytes)"),
    "normalize": _Spec(_choice(*MODES), "one of " + ", ".join(MODES)),
    "key_header": _Spec(_header_name, "a lower-case HTTP header name"),
    "tenant_headers": _Spec(_header_list, "a comma-separated list of HTTP header names"),
    "host": _Spec(_non_empty, "an address to bind, e.g. 127.0.0.1"),
    "port": _Spec(_number_in(int, 0, 65535), "a TCP port in 0..65535"),
    "metrics_port": _Spec(_number_in(int, 0, 65535), "a TCP port in 0..65535 (0 disables metrics)"),
    "drain_seconds": _Spec(_number_in(float, 0.0, 3600.0), "seconds in 0..3600"),
    "log_level": _Spec(_choice("debug", "info", "warning", "error"), "one of debug, info, warning, error"),
    "metadata_namespace": _Spec(_non_empty, "a non-empty dynamic metadata namespace"),
}
ROUTE_FIELDS: Final = tuple(f.name for f in dataclasses.fields(RouteSettings))
SERVER_FIELDS: Final = tuple(f.name for f in dataclasses.fields(ServerSettings))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def metadata_key(name: str) -> str:
    return METADATA_PREFIX + name.replace("_", "-")


def parse_value(name: str, raw: str, source: str) -> Any:
    """Parse one setting or raise SettingError naming ``source`` and the allowed values."""
    try:
        return SPECS[name].parse(raw)
    except (ValueError, TypeError):
        raise SettingError(f"invalid {source} {raw!r}: must be {SPECS[name].allowed}") from None


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Flags for ``names``, kept as raw strings (default None) so env vars can fill gaps."""
    for name in names:
        default = getattr(RouteSettings(), name, None) if name in ROUTE_FIELDS else getattr(ServerSettings(), name)
        shown = ",".join(default) if isinstance(default, tuple) else default
        parser.add_argument(
            flag(name), dest=name, default=None, metavar=name.upper(),
            help=f"{SPECS[name].allowed} (default {shown}; env {env_var(name)})",
        )


def _resolve(cls: type, args: argparse.Namespace | None, env: Mapping[str, str]) -> Any:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(args, field.name, None) if args is not None else None
        if raw is not None:
            values[field.name] = parse_value(field.name, str(raw), flag(field.name))
        elif env_var(field.name) in env:
            values[field.name] = parse_value(field.name, env[env_var(field.name)], env_var(field.name))
    return cls(**values)


def route_settings(args: argparse.Namespace | None, env: Mapping[str, str]) -> RouteSettings:
    """Flags win over env vars, which win over defaults. Raises SettingError."""
    return _resolve(RouteSettings, args, env)


def server_settings(args: argparse.Namespace | None, env: Mapping[str, str]) -> ServerSettings:
    return _resolve(ServerSettings, args, env)


_METADATA_FIELDS: Final = {metadata_key(name): name for name in ROUTE_FIELDS}


def with_metadata(
    base: RouteSettings, metadata: Iterable[tuple[str, str | bytes]]
) -> tuple[RouteSettings, list[str]]:
    """Apply ``x-prefix-router-*`` gRPC metadata; bad values are skipped and reported."""
    changes: dict[str, Any] = {}
    errors: list[str] = []
    for key, raw in metadata:
        name = _METADATA_FIELDS.get(key.lower())
        if name is None:
            continue
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        try:
            changes[name] = parse_value(name, text, f"metadata {key}")
        except SettingError as exc:
            errors.append(str(exc))
    return (dataclasses.replace(base, **changes) if changes else base), errors
