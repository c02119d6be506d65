"""Files the lab ships: tiny tokenizers built offline (make_tokenizers.py) for tests, benchmarks and the demo."""

from __future__ import annotations

from pathlib import Path
from typing import Final

ASSETS: Final = Path(__file__).resolve().parent
TINY_BYTELEVEL: Final = ASSETS / "tiny-bytelevel"  # the tiny model's own byte-level BPE and chat template
TINY_METASPACE: Final = ASSETS / "tiny-metaspace"  # a SentencePiece-style BPE with a Llama-2-like template
