"""Make tiny LoRA adapters for the tiny model offline, loadable by vLLM's ``--lora-modules``.

    PYTHONPATH=lab /work/vllm-venv/bin/python -m routerlab.realvllm.tiny_lora \\
        --base /tmp/prefix-router-tiny-llama --out /tmp/prefix-router-tiny-lora --names a,b

Each adapter is ``peft``'s LoRA (rank 8, alpha 16, on ``q_proj`` and ``v_proj``) over the base
model's random weights, its own weights random too (seeded per name, ``init_lora_weights=False``,
so two adapters really differ), written by ``save_pretrained`` as ``<out>/<name>/``
(``adapter_config.json``, ``adapter_model.safetensors``). Like the tiny model it only exercises the
serving stack. torch, transformers and peft are imported lazily: run it with a Python that has them
(the vLLM venv, after ``pip install peft``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from routerlab import LAB_DIR, REPO_DIR

RANK = 8
TARGETS = ("q_proj", "v_proj")


def is_complete(out: Path) -> bool:
    return (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()


def make_tiny_lora(base: str | Path, out: str | Path, name: str, rank: int = RANK) -> Path:
    """One adapter ``out/name`` over ``base`` (seeded by its name)."""
    import torch
    from peft import LoraConfig, get_peft_model  # type: ignore[import-not-found]  # the vLLM venv only
    from transformers import AutoModelForCausalLM

    path = Path(out) / name
    if is_complete(path):
        return path
    torch.manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big"))
    model = AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(path))
    return path


def ensure_tiny_loras(base: Path, out: Path, names: list[str], python: str) -> list[Path]:
    """Make the adapters with ``python`` (the vLLM venv's) unless they exist."""
    paths = [Path(out) / n for n in names]
    if all(is_complete(p) for p in paths):
        return paths
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(LAB_DIR), env.get("PYTHONPATH")) if p)
    env.pop("VIRTUAL_ENV", None)
    subprocess.run([python, "-m", "routerlab.realvllm.tiny_lora", "--base", str(base), "--out", str(out),
                    "--names", ",".join(names)], check=True, env=env, cwd=str(REPO_DIR), timeout=600)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.tiny_lora", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the base model directory (routerlab.realvllm.tiny_model)")
    p.add_argument("--out", required=True, help="adapters go to OUT/NAME")
    p.add_argument("--names", default="a,b", help="comma-separated adapter names (default a,b)")
    p.add_argument("--rank", type=int, default=RANK)
    a = p.parse_args(argv)
    for name in a.names.split(","):
        print(f"tiny LoRA adapter in {make_tiny_lora(a.base, a.out, name, a.rank)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
