"""The lab's `prefix-router` subcommands, registered as entry points in lab/pyproject.toml.

Importing this module is cheap (no command module is imported until it runs), so
`prefix-router --help` can list the lab's commands.
"""

from __future__ import annotations

from typing import Final

from extproc.cli import LAB_DIST as LAB
from extproc.cli import Command

SIM: Final = Command("routerlab.sim.cli", "run simulated vLLM replicas on loopback ports", dist=LAB)
BENCH: Final = Command("routerlab.bench.cli", "A/B benchmark: stock Envoy routing vs prefix routing", "bench", LAB)
MICROBENCH: Final = Command("routerlab.bench.microbench", "the router's own work per request (pure core, no gRPC)",
                            dist=LAB)
DEMO: Final = Command("routerlab.bench.demo", "short sagemaker-8k comparison (round robin vs pick mode)", "bench", LAB)
FUZZ: Final = Command("routerlab.fuzz", "hostile-input run over normalise, key and pick: exceptions, time and memory "
                      "per body", dist=LAB)
AB: Final = Command("routerlab.ab.cli", "A/B on a live fleet: switchback driver and analysis with a verdict",
                    dist=LAB)
