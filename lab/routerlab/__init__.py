"""The lab around the router: simulated vLLM fleet, A/B benchmark and drills, fuzz, microbench,
real-vLLM tooling, and the harness that starts Envoy and local processes for tests and benchmarks.

It imports the router (``extproc``); the router never imports it (import contracts in the
repository's pyproject.toml). Its files are read from the repository it is installed from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

LAB_DIR: Final = Path(__file__).resolve().parent.parent  # lab/: put on PYTHONPATH for another interpreter
REPO_DIR: Final = LAB_DIR.parent  # the repository: envoy/, compose/, deploy/, .venv
