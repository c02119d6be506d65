"""The package layering, checked by import-linter's contracts (pyproject.toml [tool.importlinter]).

The router (extproc) never imports the lab (routerlab); inside it, the process sits over the
Envoy adapters, over pick mode, over the pure core, and the core does no I/O.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from routerlab.harness.procs import venv_tool

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([venv_tool("lint-imports") or "lint-imports", "--no-cache", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_every_import_contract_is_kept() -> None:
    done = lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert done.stdout.count(" KEPT") == len(contracts) >= 5


def test_the_checker_sees_a_real_import(tmp_path: Path) -> None:
    """A contract the code breaks (the core hashes with xxhash) fails the check: the checker bites."""
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["extproc"]\ninclude_external_packages = true\n\n'
                      '[[tool.importlinter.contracts]]\nname = "no hashing in the core"\ntype = "forbidden"\n'
                      'source_modules = ["extproc.core"]\nforbidden_modules = ["xxhash"]\n')
    done = lint_imports("--config", str(config))
    assert done.returncode != 0 and "extproc.core.decide -> xxhash" in done.stdout, done.stdout
