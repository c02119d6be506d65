"""Which model a request asks for: the body's ``model``, checked before it becomes a header.

Envoy routes on headers, never on bodies, so the router copies the model (a base model or a
LoRA adapter, as vLLM's OpenAI API names it) into a header Envoy's route table matches (the
Gateway API Inference Extension's ``x-gateway-model-name``). Pure: the parsed body in, a name or
a reason out.
"""

from __future__ import annotations

from typing import Any, Final

from extproc.core.tenant import TENANT_BAD_CHARS, tenant_problem

MODEL_FIELD: Final = "model"
MODEL_FIELD_BYTES: Final = b'"model"'
# Model header outcomes (metrics label values) besides the tenant rules' reasons (too_long, bad_chars).
MODEL_SET: Final = "set"
MODEL_ABSENT: Final = "absent"  # no model field, not a string, or the body is not a whole JSON object


def body_model(doc: dict[str, Any] | None) -> tuple[str | None, str]:
    """The body's model name and the outcome: ``set``, ``absent``, or why it cannot be a header.

    A model name becomes a header value, so it follows the tenant id's rule (at most 256 printable
    ASCII characters, and no space at either end): Envoy refuses a header mutation with control
    characters, and trims spaces a replica would not (it would then be routed as another model).
    """
    value = doc.get(MODEL_FIELD) if doc else None
    if not isinstance(value, str) or not value:
        return None, MODEL_ABSENT
    problem = tenant_problem(value) or (TENANT_BAD_CHARS if value != value.strip() else None)
    return (None, problem) if problem else (value, MODEL_SET)
