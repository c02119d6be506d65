"""The adapters ``vllm:lora_requests_info`` names, as vLLM 0.32's front end counts them.

vLLM 0.32 (``vllm/v1/metrics/stats.py`` ``LoRARequestStates``, ``vllm/v1/metrics/loggers.py``):

* The front end, not the scheduler, keeps per adapter the ids of its waiting and running requests,
  from the engine's request events (QUEUED -> waiting, SCHEDULED -> running, PREEMPTED -> waiting),
  and drops a request when it finishes or is aborted; an adapter with no request left is dropped.
* Those events travel with a request's outputs, and a request has none before its first token: so
  both events of a new request arrive together with its first token, and a request that is still
  queued or prefilling is not seen at all.
* Every step's statistics then set the gauge ``vllm:lora_requests_info{max_lora, running_lora_adapters,
  waiting_lora_adapters}`` to the current Unix time, where both labels join with "," the names of
  *every* adapter tracked (each dict holds every adapter, with a count that may be 0). Label sets
  are never removed: each keeps the time it was last current, so the sample with the largest value
  is the present one.

So in vLLM 0.32 both labels name the adapters with at least one request past its first token and
not finished, in the order they were first tracked; this class reproduces that.
"""

from __future__ import annotations


class LoraRequestStates:
    """Adapter name -> ids of its requests the front end tracks (insertion ordered, as vLLM's dict)."""

    def __init__(self) -> None:
        self._requests: dict[str, set[str]] = {}

    def first_token(self, req_id: str, lora_name: str | None) -> None:
        """QUEUED and SCHEDULED, delivered with the request's first output."""
        if lora_name is not None:
            self._requests.setdefault(lora_name, set()).add(req_id)

    def finished(self, req_id: str, lora_name: str | None) -> None:
        """Finished or aborted: forget the request, and the adapter once it has none."""
        ids = self._requests.get(lora_name) if lora_name is not None else None
        if ids is None:
            return
        ids.discard(req_id)
        if not ids:
            del self._requests[lora_name]  # type: ignore[arg-type]

    def label(self) -> str:
        """The value of both ``running_lora_adapters`` and ``waiting_lora_adapters``."""
        return ",".join(self._requests)
