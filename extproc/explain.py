"""`prefix-router explain`: why did these two requests go to different replicas?

Runs the same core as the server on a body from a file or stdin, with the headers and
settings given, and prints the decision.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson

from extproc.decide import Decision, decide
from extproc.settings import ROUTE_FIELDS, RouteSettings, SettingError, add_flags, route_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("body", nargs="?", default="-", help="file with the request body ('-' or omitted: stdin)")
    parser.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
                        help="a request header, as curl takes it (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_flags(parser, ROUTE_FIELDS)


def parse_headers(raw: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in raw:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise SettingError(f"invalid -H {item!r}: expected 'name: value'")
        headers[name.strip().lower()] = value.strip()
    return headers


def as_dict(decision: Decision, settings: RouteSettings) -> dict[str, object]:
    return {
        "key": decision.key,
        "key_header": settings.key_header,
        "tenant": decision.tenant,
        "tenant_source": decision.tenant_source,
        "normalize": decision.normalize,
        "requested_normalize": settings.normalize,
        "fallback": decision.fallback,
        "prefix_bytes": decision.prefix_bytes,
        "prefix_length": settings.prefix_length,
        "normalized_bytes": decision.normalized_bytes,
        "preview": decision.preview.decode("utf-8", "replace"),
    }


def render(info: dict[str, object]) -> str:
    fallback = f" (fallback from {info['requested_normalize']}: {info['fallback']})" if info["fallback"] else ""
    tenant = f"{info['tenant']!r} from {info['tenant_source']}" if info["tenant"] else "none"
    hashed = f"{info['prefix_bytes']} of {info['normalized_bytes']} bytes (prefix_length {info['prefix_length']})"
    return "\n".join([
        f"key:        {info['key'] or '(none: empty body, Envoy picks a host at random)'}",
        f"header:     {info['key_header']}",
        f"normalize:  {info['normalize']}{fallback}",
        f"tenant:     {tenant}",
        f"hashed:     {hashed}",
        f"starts:     {info['preview']}",
    ])


def run(args: argparse.Namespace) -> int:
    try:
        settings = route_settings(args, os.environ)
        headers = parse_headers(args.header)
    except SettingError as exc:
        print(f"prefix-router explain: {exc}", file=sys.stderr)
        return 2
    try:
        body = sys.stdin.buffer.read() if args.body == "-" else open(args.body, "rb").read()
    except OSError as exc:
        print(f"prefix-router explain: cannot read {args.body}: {exc.strerror}", file=sys.stderr)
        return 2
    info = as_dict(decide(body, headers, settings), settings)
    print(orjson.dumps(info).decode() if args.json else render(info))
    return 0
