"""`prefix-router explain`: why did these two requests go to different replicas?

Runs the same core as the server on a body from a file or stdin, with the headers and
settings given, and prints the decision. Given two bodies, it also says whether they get
the same key and, if not, what differs first: the tenant, or the first byte where the
normalised forms part (inside the hashed prefix or not).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
import urllib.request
from typing import cast

import orjson

from extproc.core.decide import Decision, decide
from extproc.core.normalize import normalize
from extproc.core.settings import ROUTE_FIELDS, RouteSettings, SettingError, add_flags, metadata_key, route_settings
from extproc.pick.choice.choose import Choice
from extproc.pick.core import PickCore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("body", nargs="?", default="-", help="file with the request body ('-' or omitted: stdin)")
    parser.add_argument("other", nargs="?", default=None,
                        help="a second body file: compare the two (same key? where do they part?)")
    parser.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
                        help="a request header, as curl takes it (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--state", default=None, metavar="FILE|URL",
                        help="pick mode: the router's state (a saved /debug/state, or its URL, e.g. "
                             "http://127.0.0.1:9464/debug/state): print each replica's cached prefix, load and cost. "
                             "A URL asks the live router (its /debug/pick), so precise mode's exact view is shown")
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


def compare(a: bytes, b: bytes, headers: dict[str, str], settings: RouteSettings) -> dict[str, object]:
    """Same key or not, and the first reason they differ."""
    da, db = decide(a, headers, settings), decide(b, headers, settings)
    na, nb = normalize(a, settings.normalize).data, normalize(b, settings.normalize).data
    offset = next((i for i, (x, y) in enumerate(zip(na, nb)) if x != y), min(len(na), len(nb)))
    if da.key == db.key:
        reason = "same key: " + ("identical normalised forms" if na == nb else
                                 f"the normalised forms part at byte {offset}, after the hashed prefix")
    elif da.normalize != db.normalize:
        reason = f"different normalisation used: {da.normalize} vs {db.normalize}"
    elif da.tenant != db.tenant:
        reason = f"different tenant: {da.tenant!r} vs {db.tenant!r}"
    else:
        reason = f"normalised forms part at byte {offset}, inside the first {settings.prefix_length} hashed bytes"
    return {
        "same_key": da.key == db.key,
        "reason": reason,
        "first_difference": offset if na != nb else None,
        "context_a": na[max(0, offset - 40): offset + 40].decode("utf-8", "replace"),
        "context_b": nb[max(0, offset - 40): offset + 40].decode("utf-8", "replace"),
        "a": as_dict(da, settings),
        "b": as_dict(db, settings),
    }


def pick_dict(choice: Choice) -> dict[str, object]:
    return {"address": choice.address, "reason": choice.reason, "prompt_tokens": choice.prompt_tokens,
            "candidates": [c._asdict() for c in choice.candidates]}


def render_pick(info: dict[str, object]) -> str:
    lines = [f"pick:       {info['address'] or '(none: Envoy load balancer chooses)'} ({info['reason']}), "
             f"prompt {info['prompt_tokens']} tokens",
             f"  {'replica':24s} {'cached tokens':>13s} {'view':>16s} {'queued prefill':>14s} {'in flight':>9s} "
             f"{'cost':>9s}"]
    for c in info["candidates"]:  # type: ignore[attr-defined]
        mark = " <- chosen" if c["address"] == info["address"] else (" (at threshold)" if c["capped"] else "")
        origin = c.get("events_origin", "none")
        shown = c.get("view") == "events" or origin == "partial"  # partial: the larger of events and learned
        view = c.get("view", "learned") + (f" ({origin})" if shown else "")
        evicting = c.get("forecast_evicted_tokens", 0)  # the eviction forecast: gone before admission
        forecast = f" (forecast: {c['cached_tokens'] - evicting} by admission)" if evicting else ""
        lines.append(f"  {c['address']:24s} {c['cached_tokens']:>13d} {view:>16s} {c['backlog_tokens']:>14d} "
                     f"{c['in_flight']:>9d} {c['cost']:>9d}{mark}{forecast}")
    return "\n".join(lines)


def live_pick(state_url: str, body: bytes, headers: dict[str, str], args: argparse.Namespace) -> dict[str, object]:
    """What the live router would choose for ``body`` now (POST to its /debug/pick); only the route
    settings given on this command line override the router's own."""
    base, _, _ = state_url.partition("/debug/")
    given = {metadata_key(name): str(getattr(args, name)) for name in ROUTE_FIELDS
             if getattr(args, name, None) is not None}
    request = urllib.request.Request(f"{base.rstrip('/')}/debug/pick?{urllib.parse.urlencode(given)}", data=body,
                                     headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        choice: dict[str, object] = orjson.loads(resp.read())
    return choice


def read_state(source: str) -> dict[str, object]:
    """A pick-mode state saved from the router's /debug/state."""
    state: dict[str, object] = orjson.loads(read_body(source))
    return state


def read_body(path: str) -> bytes:
    """A file's bytes, or standard input's for ``-``."""
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def run(args: argparse.Namespace) -> int:
    try:
        settings = route_settings(args, os.environ)
        headers = parse_headers(args.header)
    except SettingError as exc:
        print(f"prefix-router explain: {exc}", file=sys.stderr)
        return 2
    try:
        body = read_body(args.body)
        other = read_body(args.other) if args.other else None
    except OSError as exc:
        print(f"prefix-router explain: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    if other is None:
        decision = decide(body, headers, settings)
        info = as_dict(decision, settings)
        text = render(info)
        if settings.mode == "pick":
            if not args.state:
                print("prefix-router explain: --mode pick needs --state FILE|URL (the router's /debug/state)",
                      file=sys.stderr)
                return 2
            try:
                if args.state.startswith(("http://", "https://")):
                    info["pick"] = live_pick(args.state, body, headers, args)
                else:
                    core = PickCore.from_state(read_state(args.state))
                    info["pick"] = pick_dict(core.evaluate(decision, settings)[0])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"prefix-router explain: cannot read the state {args.state}: {exc}", file=sys.stderr)
                return 2
            text += "\n" + render_pick(info["pick"])  # type: ignore[arg-type]
        print(orjson.dumps(info).decode() if args.json else text)
        return 0
    result = compare(body, other, headers, settings)
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        info_a, info_b = cast(dict[str, object], result["a"]), cast(dict[str, object], result["b"])  # as_dict's
        print(f"{result['reason']}\n\n--- {args.body}\n{render(info_a)}\n\n--- {args.other}\n{render(info_b)}")
        if result["first_difference"] is not None and not result["same_key"]:
            print(f"\nat byte {result['first_difference']}:\n  a: {result['context_a']}\n  b: {result['context_b']}")
    return 0
