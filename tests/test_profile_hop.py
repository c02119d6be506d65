"""lab/tools/profile_hop.py --python: the router's command line runs under cProfile and leaves a profile."""

from __future__ import annotations

import importlib.util
import json
import pstats
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_hop", ROOT / "lab" / "tools" / "profile_hop.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_router_runs_under_cprofile_and_its_profile_is_written(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 40}]}))
    out = tmp_path / "router.prof"
    given = [sys.executable, "-m", "extproc", "explain", "--json", str(body)]  # stands in for `serve`: it returns
    argv = tool().profiled_router(lambda arm, *args, **kwargs: list(given), out)
    assert argv("floor") == given and not out.exists()
    done = subprocess.run(argv("router"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["key"]  # the command ran as given, its output untouched
    decided = [v for k, v in pstats.Stats(str(out)).stats.items()  # type: ignore[attr-defined]
               if k[2] == "decide" and k[0].endswith(str(Path("core", "decide.py")))]
    assert [calls for _, calls, *_ in decided] == [1]
