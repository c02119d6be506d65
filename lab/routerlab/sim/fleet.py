"""N replicas on N loopback ports in one asyncio loop, plus a thread helper for tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from routerlab.sim.lora import LoraConfig
from routerlab.sim.profiles import DEFAULT_PROFILE, Profile, get_profile
from routerlab.sim.server import KvEventsConfig, Replica

T = TypeVar("T")


@dataclass(frozen=True)
class Pool:
    """Replicas of one base model: ``count`` replicas serving ``model`` with ``profile`` (None: the
    fleet's). CLI form ``MODEL=COUNT[:PROFILE]``."""

    model: str
    count: int
    profile: str | None = None

    @classmethod
    def parse(cls, text: str) -> Pool:
        model, sep, rest = text.rpartition("=")
        count, _, profile = rest.partition(":")
        if not sep or not model or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--pool wants MODEL=COUNT[:PROFILE] with COUNT >= 1, got {text!r}")
        if profile:
            get_profile(profile)  # an unknown profile: say so now
        return cls(model, int(count), profile or None)


@dataclass(frozen=True)
class SimConfig:
    """Fleet settings; ``None`` overrides keep the profile's value.

    ``base_port=0`` binds every replica to an ephemeral port (read them from
    ``Fleet.ports``), which is what tests should use on a shared machine.

    KV-cache events (vLLM's ZMQ publisher): replica i on HTTP port P_i publishes on
    ``P_i + kv_events_port_offset`` (0: off) and serves replay on ``P_i + kv_replay_port_offset``
    (0: none). ``tokenizer``: a model directory (Hugging Face layout) whose tokenizer and chat
    template replace the stand-in tokenizer.

    Several base models: ``pools`` (replicas in pool order, ``Pool.count`` each; ``replicas`` is then
    their sum, ``model`` must be unset). LoRA: ``lora`` (None: ``--enable-lora`` off); a
    ``--lora-modules`` entry goes to the replicas of its ``base_model_name`` (to every replica when it
    names none, or a model no pool serves).
    """

    replicas: int = 1
    base_port: int = 8100
    host: str = "127.0.0.1"
    profile: str = DEFAULT_PROFILE
    time_scale: float = 1.0
    model: str | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    scheduling_policy: str | None = None
    seed: int = 0
    kv_events_port_offset: int = 0
    kv_replay_port_offset: int = 0
    kv_events_encoding: str = "array"
    kv_events_hashes: str = "int"
    kv_events_topic: str = "kv"
    kv_events_buffer_steps: int = 10_000  # batches the replay socket keeps (vLLM's buffer_steps)
    tokenizer: str | None = None
    pools: tuple[Pool, ...] = ()
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        if not self.pools:
            return
        if self.model is not None:
            raise ValueError("--model and --pool do not go together: a pool names its model")
        total = sum(p.count for p in self.pools)
        if self.replicas not in (1, total):
            raise ValueError(f"--replicas {self.replicas} but the pools hold {total} replicas")
        names = [p.model for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is in two pools: {names}")

    @property
    def num_replicas(self) -> int:
        return sum(p.count for p in self.pools) if self.pools else self.replicas

    def replica_profiles(self) -> list[Profile]:
        """Each replica's profile, its ``model`` the base model it serves (pool order)."""
        if not self.pools:
            return [self.resolved_profile()] * self.replicas
        out: list[Profile] = []
        for pool in self.pools:
            p = self.resolved_profile(pool.profile).with_overrides(model=pool.model)
            out.extend([p] * pool.count)
        return out

    def kv_events(self) -> KvEventsConfig | None:
        """The publisher settings, None when events are off (raises ValueError on bad values)."""
        if not self.kv_events_port_offset:
            if self.kv_replay_port_offset:
                raise ValueError("kv_replay_port_offset needs kv_events_port_offset")
            return None
        return KvEventsConfig(self.kv_events_port_offset, self.kv_replay_port_offset,
                              self.kv_events_encoding, self.kv_events_hashes, self.kv_events_topic,
                              self.kv_events_buffer_steps)

    def resolved_profile(self, profile: str | None = None) -> Profile:
        """The fleet's profile (or ``profile``) with this config's overrides."""
        return get_profile(profile or self.profile).with_overrides(
            model=self.model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            scheduling_policy=self.scheduling_policy,
        )


class Fleet:
    """Running replicas; ``urls[i]`` is replica i. Call :meth:`stop` to shut down."""

    def __init__(self, config: SimConfig, replicas: list[Replica], runners: list[web.AppRunner]) -> None:
        self.config = config
        self.replicas = replicas
        self._runners = runners

    @property
    def ports(self) -> list[int]:
        return [r.port for r in self.replicas if r.port is not None]

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.config.host}:{p}" for p in self.ports]

    async def stop(self) -> None:
        for r in self.replicas:
            await r.close()
        for runner in self._runners:
            await runner.cleanup()


async def start_fleet(config: SimConfig) -> Fleet:
    """Bind and start every replica in the running event loop."""
    if config.num_replicas < 1:
        raise ValueError("replicas must be >= 1")
    profiles = config.replica_profiles()
    served = {p.model for p in profiles}
    kv_events = config.kv_events()
    tok = None
    if config.tokenizer:
        from routerlab.sim.hf_tokenizer import HfTokenizer

        tok = HfTokenizer(config.tokenizer)  # one for all replicas (one event loop)
    replicas: list[Replica] = []
    runners: list[web.AppRunner] = []
    try:
        for i, profile in enumerate(profiles):
            lora = config.lora
            modules = tuple(lora.modules_for(profile.model, served)) if lora is not None else ()
            rep = Replica(i, profile, config.time_scale, seed=config.seed, kv_events=kv_events,
                          tokenizer=tok, host=config.host, lora=lora, lora_modules=modules)
            rep.engine.start()
            replicas.append(rep)
            # handler_cancellation: a client that disconnects aborts its request, as in vLLM
            runner = web.AppRunner(rep.app, access_log=None, handle_signals=False,
                                   handler_cancellation=True)
            await runner.setup()
            runners.append(runner)
            port = 0 if config.base_port == 0 else config.base_port + i
            site = web.TCPSite(runner, config.host, port, backlog=1024)
            await site.start()
            server = site._server  # the asyncio Server: read the bound port
            # typed as AbstractServer, which declares no sockets; asyncio's and uvloop's Server have them
            assert server is not None and server.sockets  # type: ignore[attr-defined]
            rep.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            await rep.open_kv_events()
    except BaseException:
        await Fleet(config, replicas, runners).stop()
        raise
    return Fleet(config, replicas, runners)


class FleetThread:
    """A fleet running in its own event loop on a background thread (for sync tests)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-fleet", daemon=True)
        self.fleet: Fleet | None = None

    def start(self, timeout: float = 10.0) -> Fleet:
        self._thread.start()
        self.fleet = self.call(start_fleet(self.config), timeout)
        return self.fleet

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run a coroutine on the fleet's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.fleet is not None:
            self.call(self.fleet.stop(), timeout)
            self.fleet = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


@contextlib.contextmanager
def run_fleet_in_thread(config: SimConfig) -> Iterator[Fleet]:
    """``with run_fleet_in_thread(SimConfig(replicas=2, base_port=0)) as fleet: ...``"""
    ft = FleetThread(config)
    try:
        yield ft.start()
    finally:
        ft.stop()
