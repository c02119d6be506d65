"""`prefix-router` command line: one subcommand per module, imported only when used.

The router's own commands (serve, health, explain) live here. The lab's commands (sim,
bench, microbench, demo, fuzz, ab) live in the lab distribution, which registers them under the
``prefix_router.commands`` entry-point group: the router finds them without importing the
lab, and a production install without the lab says in one line what to install.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` so that
starting the server never pays for importing the simulator or the plotting stack.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from dataclasses import dataclass
from typing import Final

from extproc import extras

DIST: Final = "envoy-prefix-router"
LAB_DIST: Final = "envoy-prefix-router-lab"
LAB_GROUP: Final = "prefix_router.commands"
# Named only so that a router-only install can say where they are.
LAB_NAMES: Final = ("sim", "bench", "microbench", "demo", "fuzz", "ab")


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its module, its one-line help, and the extra of its distribution it needs."""

    module: str
    help: str
    extra: str | None = None
    dist: str = DIST


COMMANDS: Final[dict[str, Command]] = {
    "serve": Command("extproc.process.serve", "run the ext_proc / ext_authz gRPC server Envoy consults"),
    "health": Command("extproc.process.health", "ask a running router its gRPC health (exit 0: serving), for probes"),
    "explain": Command("extproc.process.explain", "show how a request body becomes a prefix key"),
}


def lab_commands() -> dict[str, Command]:
    """The lab's commands, from its entry points ({} when the lab is not installed)."""
    found: dict[str, Command] = {}
    for point in importlib.metadata.entry_points(group=LAB_GROUP):
        try:
            command = point.load()
        except ImportError:  # a lab left half-uninstalled: treated as absent, so the hint says what to do
            continue
        if isinstance(command, Command) and point.name not in COMMANDS:
            found[point.name] = command
    return dict(sorted(found.items(), key=lambda item: LAB_NAMES.index(item[0]) if item[0] in LAB_NAMES else 99))


def lab_hint(command: str) -> str:
    """The one line a router-only install prints for a lab command."""
    return (f"prefix-router {command} is part of the lab, which this install does not have: "
            f"pip install ./lab (the {LAB_DIST} distribution, from the repository's lab/ folder)")


def build_parser(commands: dict[str, Command], command: str | None = None) -> argparse.ArgumentParser:
    """Parser for all subcommands; only ``command``'s module is imported (for its flags)."""
    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in commands.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        if name == command:
            mod = importlib.import_module(spec.module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    commands = COMMANDS if command in COMMANDS else {**COMMANDS, **lab_commands()}
    if command in LAB_NAMES and command not in commands:
        print(lab_hint(command), file=sys.stderr)
        return 2
    spec = commands.get(command or "")
    if spec and spec.extra and (absent := extras.missing(spec.extra, spec.dist)):
        print(extras.install_hint(command or "", spec.dist, spec.extra, absent), file=sys.stderr)
        return 2
    args = build_parser(commands, command if spec else None).parse_args(argv)
    return int(args._run(args) or 0)
