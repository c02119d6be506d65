"""N real vLLM CPU servers on loopback ports: what each runs, and starting, health-waiting, stopping them.

Each server is ``python -m vllm.entrypoints.openai.api_server`` with
``VLLM_CPU_OMP_THREADS_BIND=<core>`` (replica i on core i mod cores), caches under a temp dir
(``VLLM_CACHE_ROOT``, ``XDG_CACHE_HOME``, ``HF_HOME``), ``HF_HUB_OFFLINE=1``,
``--enable-prefix-caching`` and, when given, ``--block-size``, ``--num-gpu-blocks-override``,
``--enable-prompt-tokens-details`` and a ``--kv-events-config`` that publishes KV-cache events
(replica port + ``kv_events_offset``, bound on every interface since vLLM binds its PUB socket only
for a wildcard endpoint; its replay socket on 127.0.0.1:<replica port + ``kv_replay_offset``>: the
router's ``--kv-ports-relative on``). Logs go to ``<workdir>/vllm-<port>.log``. Usage and CLI:
:mod:`routerlab.realvllm.launcher`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from routerlab.realvllm import promtext
from routerlab.realvllm.procs import last_line, log_tail, port_free, rss_mb_tree

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
CPU_BLOCK_MULTIPLE = 32  # vllm-cpu 0.32's CPU attention backend: block_size % 32 == 0


class VllmStartError(RuntimeError):
    """A server exited or did not become healthy in time."""


class VllmFleet:
    """N real vLLM CPU servers on ``host:base_port+i``.

    Parameters
    ----------
    model: model directory (e.g. from :mod:`routerlab.realvllm.tiny_model`).
    replicas: number of servers.
    base_port: replica i listens on ``base_port + i``.
    python: interpreter of the venv that has ``vllm-cpu`` installed.
    block_size: ``--block-size`` (None: the CPU build's default, 128 in vllm-cpu 0.32; it
        must be a multiple of 32 there, e.g. 32, 64, 128, 256).
    num_gpu_blocks: ``--num-gpu-blocks-override`` (None: sized from ``kv_cache_space_gb``).
    max_model_len: ``--max-model-len``.
    max_num_batched_tokens: ``--max-num-batched-tokens`` (None: vLLM's default).
    max_num_seqs: ``--max-num-seqs`` (None: vLLM's default).
    kv_cache_space_gb: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache per server).
    cores: CPU core per replica for ``VLLM_CPU_OMP_THREADS_BIND`` (default: i mod cpu count).
    served_model_name: ``--served-model-name`` (default: the model path, vLLM's default).
    dev_mode: set ``VLLM_SERVER_DEV_MODE=1`` so that ``POST /reset_prefix_cache`` works
        (see :meth:`reset_prefix_cache`; benchmarks use it between runs).
    prompt_tokens_details: ``--enable-prompt-tokens-details`` (usage carries
        ``prompt_tokens_details.cached_tokens``).
    kv_events_offset: publish KV-cache events (ZMQ PUB, topic ``kv_events_topic``) on
        ``127.0.0.1:<replica port + offset>`` (None: no events).
    kv_replay_offset: the replay socket on ``<replica port + offset>`` (None: none).
    extra_args: more api_server arguments, appended as is.
    extra_env: more environment variables for the servers.
    workdir: where logs and caches go (default: a new temp dir, removed by :meth:`stop`
        unless ``keep_workdir``).
    startup_timeout: seconds to wait for every /health.
    progress: called with one line of progress text (default: print to stderr).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        replicas: int = 1,
        base_port: int = 8200,
        python: str = DEFAULT_VLLM_PYTHON,
        *,
        host: str = "127.0.0.1",
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        max_model_len: int = 8192,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        kv_cache_space_gb: int = 2,
        cores: Sequence[int] | None = None,
        served_model_name: str | None = None,
        dev_mode: bool = False,
        prompt_tokens_details: bool = False,
        kv_events_offset: int | None = None,
        kv_replay_offset: int | None = None,
        kv_events_topic: str = "kv",
        extra_args: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        workdir: str | os.PathLike | None = None,
        keep_workdir: bool = False,
        startup_timeout: float = 420.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        if block_size is not None and block_size % CPU_BLOCK_MULTIPLE:
            # vllm-cpu 0.32: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
            raise ValueError(f"block_size {block_size}: the vLLM CPU attention backend needs "
                             f"a multiple of {CPU_BLOCK_MULTIPLE}")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("only loopback hosts are allowed")
        self.model = str(Path(model).resolve())
        self.replicas = replicas
        self.base_port = base_port
        self.python = python
        self.host = host
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_cache_space_gb = kv_cache_space_gb
        ncpu = os.cpu_count() or 1
        self.cores = list(cores) if cores is not None else [i % ncpu for i in range(replicas)]
        if len(self.cores) != replicas:
            raise ValueError("cores must have one entry per replica")
        self.served_model_name = served_model_name
        self.dev_mode = dev_mode
        self.prompt_tokens_details = prompt_tokens_details
        self.kv_events_offset = kv_events_offset
        self.kv_replay_offset = kv_replay_offset
        self.kv_events_topic = kv_events_topic
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else None
        self.keep_workdir = keep_workdir
        self.startup_timeout = startup_timeout
        self.progress = progress or (lambda s: print(s, file=sys.stderr, flush=True))
        self.procs: list[subprocess.Popen] = []
        self.startup_seconds: list[float] = []
        self._logs: list[Path] = []

    # ----------------------------------------------------------------- properties
    @property
    def ports(self) -> list[int]:
        return [self.base_port + i for i in range(self.replicas)]

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.ports]

    @property
    def kv_event_urls(self) -> list[str]:
        """Each replica's KV-event PUB endpoint (empty without events)."""
        if self.kv_events_offset is None:
            return []
        return [f"tcp://{self.host}:{p + self.kv_events_offset}" for p in self.ports]

    @property
    def kv_replay_urls(self) -> list[str]:
        """Each replica's replay (ROUTER) endpoint (empty without one)."""
        if self.kv_events_offset is None or self.kv_replay_offset is None:
            return []
        return [f"tcp://{self.host}:{p + self.kv_replay_offset}" for p in self.ports]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def log_paths(self) -> list[Path]:
        return list(self._logs)

    # ----------------------------------------------------------------- commands
    def command(self, i: int) -> list[str]:
        """The argv that starts replica ``i``."""
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.ports[i]),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.prompt_tokens_details:
            cmd += ["--enable-prompt-tokens-details"]
        if self.kv_events_offset is not None:
            cmd += ["--kv-events-config", json.dumps(self.kv_events_config(i))]
        return cmd + self.extra_args

    def kv_events_config(self, i: int) -> dict[str, object]:
        """Replica ``i``'s ``--kv-events-config`` (vLLM's KVEventsConfig fields), loopback only."""
        assert self.kv_events_offset is not None
        port = self.ports[i]
        # vLLM 0.32 binds the PUB socket only for a wildcard endpoint and CONNECTS it for a host
        # (ZmqEventPublisher._is_bind_endpoint): "tcp://127.0.0.1:P" would publish to nobody.
        cfg: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://*:{port + self.kv_events_offset}",
                                  "topic": self.kv_events_topic}
        if self.kv_replay_offset is not None:
            cfg["replay_endpoint"] = f"tcp://{self.host}:{port + self.kv_replay_offset}"
        return cfg

    def environment(self, i: int) -> dict[str, str]:
        """The environment of replica ``i`` (the current one plus vLLM CPU settings)."""
        assert self.workdir is not None
        cache = self.workdir / f"cache-{self.ports[i]}"
        env = dict(os.environ)
        # Never let the parent's venv leak into vLLM's interpreter.
        for k in ("VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(k, None)
        env.update({
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gb),
            "VLLM_CPU_OMP_THREADS_BIND": str(self.cores[i]),
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "XDG_CACHE_HOME": str(cache / "xdg"),
            "HF_HOME": str(cache / "hf"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        })
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.extra_env)
        return env

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> list[str]:
        """Start every replica and wait until all answer /health; returns :attr:`urls`."""
        if self.procs:
            raise RuntimeError("fleet already started")
        if not Path(self.python).exists():
            raise VllmStartError(f"vLLM python not found: {self.python}")
        for port in self.ports + [p + o for p in self.ports for o in (self.kv_events_offset, self.kv_replay_offset)
                                  if o is not None and self.kv_events_offset is not None]:
            if not port_free(self.host, port):
                raise VllmStartError(f"port {port} on {self.host} is in use")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="vllm-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            for i in range(self.replicas):
                log = self.workdir / f"vllm-{self.ports[i]}.log"
                self._logs.append(log)
                with open(log, "wb") as fh:
                    proc = subprocess.Popen(
                        self.command(i), env=self.environment(i), stdout=fh,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        cwd=str(self.workdir), start_new_session=True,
                    )
                self.procs.append(proc)
                self.progress(f"[vllm] replica {i} pid {proc.pid} core {self.cores[i]} "
                              f"port {self.ports[i]} log {log}")
            self._wait_healthy(t0)
        except BaseException:
            self.keep_workdir = True  # keep the logs of a failed start
            self.stop()
            self.progress(f"[vllm] start failed; logs kept in {self.workdir}")
            raise
        return self.urls

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        ready = [False] * self.replicas
        last_report = 0.0
        while not all(ready):
            now = time.monotonic()
            if now > deadline:
                raise VllmStartError(
                    f"vLLM not healthy after {self.startup_timeout:.0f} s: "
                    + ", ".join(u for u, r in zip(self.urls, ready) if not r)
                    + "\n" + self._log_tails())
            for i, proc in enumerate(self.procs):
                if ready[i]:
                    continue
                rc = proc.poll()
                if rc is not None:
                    raise VllmStartError(
                        f"vLLM replica {i} (port {self.ports[i]}) exited with {rc}\n"
                        + log_tail(self._logs[i]))
                try:
                    status, _ = promtext.http_get(self.urls[i] + "/health", timeout=2.0)
                except OSError:
                    status = 0
                if status == 200:
                    ready[i] = True
                    self.startup_seconds.append(now - t0)
                    self.progress(f"[vllm] replica {i} {self.urls[i]} healthy after "
                                  f"{now - t0:.0f} s, rss {rss_mb_tree(proc.pid):.0f} MB")
            if now - last_report >= 10.0 and not all(ready):
                last_report = now
                waiting = [i for i in range(self.replicas) if not ready[i]]
                rss = ", ".join(f"{self.ports[i]}: {rss_mb_tree(self.procs[i].pid):.0f} MB"
                                for i in waiting)
                self.progress(f"[vllm] waiting for /health ({now - t0:.0f} s; rss {rss}; "
                              f"last log line: {last_line(self._logs[waiting[0]])})")
            time.sleep(1.0)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every replica by PID: SIGTERM to its process group, SIGKILL after ``timeout``."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # its own session: pgid == pid
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
            # The engine-core child may outlive the API server: clear the whole group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.procs:
            self.progress(f"[vllm] stopped pids {self.pids}")
        self.procs = []
        if self.workdir and self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VllmFleet:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------- helpers
    def cache_config(self, i: int = 0) -> dict[str, str]:
        """Labels of replica i's ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...)."""
        return promtext.cache_config(self.urls[i])

    def reset_prefix_cache(self) -> list[bool]:
        """POST /reset_prefix_cache on every replica (needs ``dev_mode=True``); which worked.

        A reset leaves every block free and without a hash, which for prefix-cache purposes
        is the same as a fresh server (counters keep counting: use deltas).
        """
        return [promtext.reset_prefix_cache(u) for u in self.urls]

    def rss_mb(self, i: int = 0) -> float:
        """Resident memory of replica i (API server + engine core), MB."""
        return rss_mb_tree(self.procs[i].pid) if i < len(self.procs) else 0.0

    def _log_tails(self) -> str:
        return "\n".join(log_tail(log) for log in self._logs)
