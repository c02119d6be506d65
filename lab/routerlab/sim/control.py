"""Per-replica fault-injection knobs behind ``POST /sim/control`` / ``GET /sim/state``."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any


class ControlError(ValueError):
    """A control request with an unknown field or a bad value (becomes a 400)."""


@dataclass
class Control:
    """Knobs a test or fault drill can flip at run time.

    healthy: /health and /ping answer 503 when False (requests are still served).
    slow_factor: multiplies every step's model time (> 0).
    fail_rate: fraction (0..1) of inference requests answered with a 500.
    drop_connections: close the TCP connection without a response (all but /sim/*).
    One-off actions (not state): reset_cache, restart (see server.Replica.restart).
    """

    healthy: bool = True
    slow_factor: float = 1.0
    fail_rate: float = 0.0
    drop_connections: bool = False
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_rng")
        return d

    def should_fail(self) -> bool:
        return self.fail_rate > 0 and self._rng.random() < self.fail_rate

    def apply(self, body: Any) -> frozenset[str]:
        """Validate and apply a control JSON object; returns the one-off actions asked for
        (``"reset_cache"``, ``"restart"``), which the replica carries out."""
        if not isinstance(body, dict):
            raise ControlError("control body must be a JSON object")
        allowed = {"healthy", "slow_factor", "fail_rate", "drop_connections", "reset_cache", "restart", "seed"}
        unknown = set(body) - allowed
        if unknown:
            raise ControlError(f"unknown control fields: {sorted(unknown)}")
        new = {}
        for key in ("healthy", "drop_connections", "reset_cache", "restart"):
            if key in body and not isinstance(body[key], bool):
                raise ControlError(f"{key} must be a boolean")
        if "slow_factor" in body:
            v = body["slow_factor"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ControlError("slow_factor must be a number > 0")
            new["slow_factor"] = float(v)
        if "fail_rate" in body:
            v = body["fail_rate"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ControlError("fail_rate must be a number in [0, 1]")
            new["fail_rate"] = float(v)
        if "seed" in body:
            if isinstance(body["seed"], bool) or not isinstance(body["seed"], int):
                raise ControlError("seed must be an integer")
            self._rng.seed(body["seed"])
        for key in ("healthy", "drop_connections"):
            if key in body:
                new[key] = body[key]
        for k, v in new.items():
            setattr(self, k, v)
        return frozenset(k for k in ("reset_cache", "restart") if body.get(k) is True)
