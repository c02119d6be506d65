"""``prefix-router sim``: run simulated vLLM replicas, or poke one replica's control API."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

import orjson

from extproc.process import event_loop
from extproc.process.signals import stop_on_signals
from routerlab.sim.profiles import DEFAULT_PROFILE, PROFILES, SCHEDULING_POLICIES

if TYPE_CHECKING:  # fleet pulls in aiohttp: imported only when serving
    from routerlab.sim.fleet import Pool, SimConfig
    from routerlab.sim.lora import LoraConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="number of replicas (default 1)")
    parser.add_argument("--base-port", type=int, default=8100,
                        help="replica i listens on base-port + i (0: ephemeral ports)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                        help=f"engine profile (default {DEFAULT_PROFILE})")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="speed-up: simulated durations are divided by this (10 = 10x faster)")
    parser.add_argument("--model", default=None, help="served model name (default: the profile's)")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks incl. the null block")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
                        help="vLLM's: fcfs (default) or priority (the body's priority field, lower first)")
    parser.add_argument("--seed", type=int, default=0, help="seed for fail_rate draws")
    parser.add_argument("--kv-events-port-offset", type=int, default=0, metavar="N",
                        help="publish KV-cache events (vLLM's ZMQ format) on each replica's port + N (0: off)")
    parser.add_argument("--kv-replay-port-offset", type=int, default=0, metavar="N",
                        help="serve KV-event replay (ROUTER) on each replica's port + N (0: no replay socket)")
    parser.add_argument("--kv-events-encoding", choices=("array", "map"), default="array",
                        help="inner event layout: array (vLLM before June 2026) or map (after)")
    parser.add_argument("--kv-events-hashes", choices=("int", "bytes"), default="int",
                        help="block hashes in events: int (vLLM's default) or bytes")
    parser.add_argument("--kv-events-topic", default="kv", help="topic of the KV event messages (default kv)")
    parser.add_argument("--kv-events-buffer-steps", type=int, default=10_000, metavar="N",
                        help="event batches the replay socket keeps (vLLM's buffer_steps, default 10000)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="tokenise with this model directory's tokenizer and chat template "
                             "(Hugging Face layout) instead of the stand-in")
    parser.add_argument("--pool", dest="pools", action="append", default=[], metavar="MODEL=COUNT[:PROFILE]",
                        help="COUNT replicas serving base model MODEL (with PROFILE, default --profile); "
                             "repeat for several models, replicas in the order given (replaces --model)")
    lora = parser.add_argument_group("LoRA adapters (as vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch (default 1)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in CPU memory, LRU (default: --max-loras)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH|JSON",
                      help='adapters registered at start: name=path, or {"name","path","base_model_name"} '
                           "(a fleet of several models: only that base model's replicas)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"),
                      help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1|true, as vLLM)")
    lora.add_argument("--lora-load-s", type=float, default=None, metavar="SECONDS",
                      help="model seconds to read an adapter from disk into CPU memory (default: the profile's)")
    lora.add_argument("--lora-activate-s", type=float, default=None, metavar="SECONDS",
                      help="model seconds to copy an adapter from CPU memory into a GPU slot (default: the profile's)")
    parser.add_argument("--control", metavar="URL", default=None,
                        help="instead of serving: send --set values to URL's /sim/control")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="with --control: healthy=false, slow_factor=3, fail_rate=0.5, "
                             "drop_connections=true, reset_cache=true (repeatable)")


def _parse_value(text: str) -> object:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _control(url: str, settings: list[str]) -> int:
    body: dict[str, object] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--set needs KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        body[key.strip()] = _parse_value(value.strip())
    base = url.rstrip("/")
    if body:
        req = urllib.request.Request(base + "/sim/control", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}, method="POST")
    else:
        req = urllib.request.Request(base + "/sim/state")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            print(resp.read().decode())
            return 0
    except urllib.error.HTTPError as e:
        print(e.read().decode(), file=sys.stderr)
        return 1
    except OSError as e:  # refused, unreachable, timed out
        print(f"sim --control: {base}: {e}", file=sys.stderr)
        return 1


async def _serve(config: SimConfig) -> int:
    from routerlab.sim.fleet import start_fleet

    stop = stop_on_signals()
    fleet = await start_fleet(config)
    profiles = config.replica_profiles()
    for p in dict.fromkeys(profiles):  # one line per pool (one for a fleet of one model)
        count = f" replicas={profiles.count(p)}" if config.pools else ""
        print(f"sim: profile={p.name} model={p.model} block_size={p.block_size} "
              f"num_blocks={p.num_blocks} max_num_seqs={p.max_num_seqs} "
              f"max_num_batched_tokens={p.max_num_batched_tokens} max_model_len={p.max_model_len} "
              f"scheduling_policy={p.scheduling_policy} "
              f"time_scale={config.time_scale}{count}"
              + (f" tokenizer={config.tokenizer}" if config.tokenizer else ""), flush=True)
    if config.lora is not None:
        lora = config.lora
        print(f"sim: lora max_loras={lora.max_loras} max_cpu_loras={lora.cpu_capacity} "
              f"modules={','.join(m.name for m in lora.modules) or '-'} "
              f"runtime_updating={str(lora.runtime_updating).lower()}", flush=True)
    for rep, url in zip(fleet.replicas, fleet.urls):
        print(f"replica {rep.index} ready on {url}", flush=True)
    if config.kv_events_port_offset:
        for rep in fleet.replicas:
            assert rep.port is not None
            replay = (f" replay tcp://{config.host}:{rep.port + config.kv_replay_port_offset}"
                      if config.kv_replay_port_offset else "")
            print(f"replica {rep.index} kv events on tcp://{config.host}:{rep.port + config.kv_events_port_offset}"
                  f"{replay}", flush=True)
    print(f"fleet ready: {len(fleet.replicas)} replicas", flush=True)
    try:
        await stop.wait()
    finally:
        await fleet.stop()
    print("sim: stopped", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.control:
        return _control(args.control, args.settings)
    if args.replicas < 1:
        print("--replicas must be >= 1", file=sys.stderr)
        return 2
    if args.lora_modules and not args.enable_lora:
        print("sim: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    if args.time_scale <= 0:
        print("--time-scale must be > 0", file=sys.stderr)
        return 2
    from routerlab.sim.fleet import Pool
    from routerlab.sim.lora import LoraConfig, LoraModule

    try:
        pools = tuple(Pool.parse(p) for p in args.pools)
        lora = LoraConfig(args.max_loras, args.max_cpu_loras, tuple(LoraModule.parse(m) for m in args.lora_modules),
                          args.allow_runtime_lora_updating, args.lora_load_s,
                          args.lora_activate_s) if args.enable_lora else None
        config = _config(args, pools, lora)
        config.replica_profiles()  # every override applies to every pool's profile
        config.kv_events()
        if config.tokenizer:
            from routerlab.sim.hf_tokenizer import HfTokenizer

            HfTokenizer(config.tokenizer)  # a bad directory: exit 2 now, not a traceback later
    except ValueError as e:
        print(f"sim: {e}", file=sys.stderr)
        return 2
    try:
        return event_loop.run(_serve(config))
    except OSError as e:
        print(f"sim: cannot bind: {e}", file=sys.stderr)
        return 1


def _config(args: argparse.Namespace, pools: tuple[Pool, ...], lora: LoraConfig | None) -> SimConfig:
    from routerlab.sim.fleet import SimConfig

    return SimConfig(
        replicas=args.replicas, base_port=args.base_port, host=args.host, profile=args.profile,
        time_scale=args.time_scale, model=args.model, block_size=args.block_size,
        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy, seed=args.seed, kv_events_port_offset=args.kv_events_port_offset,
        kv_replay_port_offset=args.kv_replay_port_offset, kv_events_encoding=args.kv_events_encoding,
        kv_events_hashes=args.kv_events_hashes, kv_events_topic=args.kv_events_topic,
        kv_events_buffer_steps=args.kv_events_buffer_steps, tokenizer=args.tokenizer, pools=pools, lora=lora,
    )
