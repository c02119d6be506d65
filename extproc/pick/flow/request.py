"""What flow control reads of a request (pure): its tenant and what serving it will cost (its priority
class is extproc.core.priority's)."""

from __future__ import annotations

from typing import Final

from extproc.core.decide import Decision
from extproc.metrics import NO_TENANT
from extproc.pick.views.learned import BYTES_PER_TOKEN

# The virtual token counter's weights (Sheng et al. weigh an output token twice an input one: a
# decode step costs a sequence slot for as long as a whole prefill chunk costs the batch)
INPUT_WEIGHT: Final = 1.0
OUTPUT_WEIGHT: Final = 2.0
_OUTPUT_FIELDS: Final = ("max_completion_tokens", "max_tokens")


def tenant_of(decision: Decision) -> str:
    return decision.tenant or NO_TENANT


def tokens_of(decision: Decision) -> float:
    """What serving the request costs its tenant: its prompt's tokens (estimated from the normalised
    prompt's bytes) and, twice over, the output it asks for (``max_completion_tokens`` or
    ``max_tokens``; none: nothing counted)."""
    prompt = decision.normalized_bytes / BYTES_PER_TOKEN
    output = 0
    document = decision.document
    if document is not None:
        for field in _OUTPUT_FIELDS:
            value = document.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                output = value
                break
    return INPUT_WEIGHT * prompt + OUTPUT_WEIGHT * min(output, 1 << 20)
