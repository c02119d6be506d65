"""Real vLLM (CPU) vs the simulator on base models and LoRA adapters.

    .venv/bin/python -m routerlab.realvllm.lora_fidelity --vllm-python /work/vllm-venv/bin/python \\
        --max-loras 1 --markdown /tmp/lora-fidelity.md --json /tmp/lora-fidelity.json

Makes the tiny model and three tiny adapters offline if missing (:mod:`~routerlab.realvllm.tiny_model`,
:mod:`~routerlab.realvllm.tiny_lora`), starts one real vLLM server with ``--enable-lora --max-loras N
--max-cpu-loras M --lora-modules a=... b=...`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and one
simulator replica with the same flags and served name, runs the same probes on both
(:mod:`~routerlab.realvllm.lora_probes`: the ``vllm:lora_requests_info`` text before any request,
``/v1/models``, the batch's adapter limit with two concurrent adapters and the gauge meanwhile, the
cached tokens of one prompt under two adapters and the base model, the load and unload endpoints'
answers), and prints one row per observation: real, sim, same. Exit 0 iff every row is the same,
except the rows known to differ (listed in docs/fidelity.md). ``--vllm-url`` / ``--sim-url`` use
running servers (fresh ones: the probes expect adapters a and b only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from routerlab.realvllm import lora_probes
from routerlab.realvllm.fidelity import DEFAULT_MODEL_DIR, SimProcess, comparison_lines, log
from routerlab.realvllm.launcher import DEFAULT_VLLM_PYTHON, VllmFleet
from routerlab.realvllm.lora_probes import Server
from routerlab.realvllm.tiny_lora import ensure_tiny_loras
from routerlab.realvllm.tiny_model import ensure_tiny_model

DEFAULT_ADAPTERS_DIR = Path(tempfile.gettempdir()) / "prefix-router-tiny-lora"
BLOCK_SIZE = 128  # the CPU build's default
NUM_BLOCKS = 512
KNOWN_DIFFERENCES = {"load from a path that does not exist"}  # the simulator never reads an adapter's path
INFORMATION = {"load_times_ms", "batch: client ms from A's last chunk to B's first"}  # timings: shown, not compared


def lora_flags(max_loras: int, max_cpu_loras: int, adapters: dict[str, str]) -> list[str]:
    """The LoRA flags both servers get (``--lora-modules`` last: it takes every argument after it)."""
    return ["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras),
            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]


def observe(server: Server, c_path: str, long_tokens: int) -> dict[str, Any]:
    """Every probe on one server, in an order that keeps them independent (fresh server)."""
    probes: dict[str, Callable[[], Any]] = {
        "lora_info_text_at_start": server.lora_info_text,
        "models": lambda: lora_probes.models(server),
        "batch": lambda: lora_probes.batch(server, long_tokens),
        "keyed_blocks": lambda: lora_probes.keyed_blocks(server),
        "load_unload": lambda: lora_probes.load_unload(server, c_path),
        "load_times_ms": lambda: lora_probes.load_times(server),
        "load from a path that does not exist": lambda: lora_probes.missing_path(server),
    }
    out = {}
    for name, probe in probes.items():
        log(f"[lora-fidelity] {server.url}: {name}")
        out[name] = probe()
    return out


def rows(real: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per observation (a list observation of steps: one row per step)."""
    out = []
    for probe, value in real.items():
        if probe == "load_unload":
            for r, s in zip(value, sim[probe]):
                out.append(_row(f"{probe}: {r['step']}", r, s))
        elif probe == "batch":
            for key in value:
                out.append(_row(f"{probe}: {key}", value[key], sim[probe].get(key)))
        else:
            out.append(_row(probe, value, sim.get(probe)))
    return out


def _row(check: str, real: Any, sim: Any) -> dict[str, Any]:
    same = None if check in INFORMATION else real == sim
    return {"check": check, "real": real, "sim": sim, "same": same, "known": check in KNOWN_DIFFERENCES | INFORMATION}


def markdown(table: list[dict[str, Any]], max_loras: int) -> str:
    return "\n".join([f"max_loras={max_loras}", "", *comparison_lines(table)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.lora_fidelity",
                                description="real vLLM vs simulator: LoRA adapters")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the vLLM venv's python (with peft)")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="tiny model dir (made if missing)")
    p.add_argument("--adapters", default=str(DEFAULT_ADAPTERS_DIR), help="tiny adapters dir (made if missing)")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-cpu-loras", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=64, help="tokens of the request that holds the slot")
    p.add_argument("--vllm-port", type=int, default=8291)
    p.add_argument("--vllm-url", default=None, help="use this running vLLM instead of starting one")
    p.add_argument("--sim-python", default=sys.executable, help="python for `-m extproc sim`")
    p.add_argument("--sim-port", type=int, default=8391)
    p.add_argument("--sim-url", default=None, help="use this running simulator instead of starting one")
    p.add_argument("--json", default=None, help="write the observations and rows here")
    p.add_argument("--markdown", default=None, help="write the table here")
    a = p.parse_args(argv)

    model = str(Path(a.model).resolve())
    paths = [str(x) for x in ensure_tiny_loras(Path(model), Path(a.adapters), ["a", "b", "c"], a.vllm_python)]
    adapters = {"a": paths[0], "b": paths[1]}
    flags = lora_flags(a.max_loras, a.max_cpu_loras, adapters)
    fleet: VllmFleet | None = None
    sim: SimProcess | None = None
    try:
        real_url = a.vllm_url
        if real_url is None:
            ensure_tiny_model(Path(model), a.vllm_python)
            fleet = VllmFleet(model, 1, a.vllm_port, a.vllm_python, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                              prompt_tokens_details=True, extra_args=flags,
                              extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
            real_url = fleet.start()[0]
        sim_url = a.sim_url
        if sim_url is None:
            sim = SimProcess(a.sim_python, a.sim_port, BLOCK_SIZE, NUM_BLOCKS, 8192, time_scale=1.0,
                             extra_args=["--model", model, "--allow-runtime-lora-updating", *flags])
            sim_url = sim.start()
        real = observe(Server(real_url, model, adapters), paths[2], a.long_tokens)
        simulated = observe(Server(sim_url, model, adapters), paths[2], a.long_tokens)
    finally:
        if sim is not None:
            sim.stop()
        if fleet is not None:
            fleet.stop()
    table = rows(real, simulated)
    text = markdown(table, a.max_loras)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"max_loras": a.max_loras, "max_cpu_loras": a.max_cpu_loras,
                                            "real": real, "sim": simulated, "rows": table}, indent=1))
    bad = [r["check"] for r in table if not r["same"] and not r["known"]]
    print("LORA FIDELITY OK" if not bad else f"LORA FIDELITY DIFFERS: {', '.join(bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
