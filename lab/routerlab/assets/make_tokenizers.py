"""Build the two tiny tokenizers the repository ships, offline and deterministically.

    .venv/bin/python lab/routerlab/assets/make_tokenizers.py     # rewrites both folders

- ``tiny-bytelevel/``: the byte-level BPE of ``routerlab.realvllm.tiny_model`` (same corpus
  generator, seed, special tokens, vocabulary 4096, post-processor and chat template), so the
  tiny model vLLM serves and the router's tokenizer are the same tokenizer.
- ``tiny-metaspace/``: a SentencePiece-style BPE (Metaspace pre-tokenizer, ``prepend_scheme``
  "first", byte fallback off), vocabulary about 2000, ``<s>``/``</s>``/``<unk>`` as added special
  tokens and a Llama-2-like chat template (``[INST]``, ``<<SYS>>``, tools as JSON).

Each folder holds ``tokenizer.json`` and ``tokenizer_config.json`` in the Hugging Face layout.
Only the ``tokenizers`` library is needed (no transformers, no torch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
if str(HERE.parent.parent) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(HERE.parent.parent))

from routerlab.realvllm.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, generate_corpus  # noqa: E402

BYTELEVEL_DIR = HERE / "tiny-bytelevel"
METASPACE_DIR = HERE / "tiny-metaspace"

METASPACE_SPECIAL = ["<unk>", "<s>", "</s>"]

# Llama-2's template in spirit: the system prompt inside the first [INST] as <<SYS>>, BOS before
# every user turn, EOS after every assistant turn; plus the tools as JSON when given.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% if tools %}{% set tools_text = '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]\\n' %}"
    "{% else %}{% set tools_text = '' %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + tools_text + message['content'] %}"
    "{% elif loop.index0 == 0 %}{% set content = tools_text + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    return {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }


def _write(out: Path, tok: Tokenizer, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    config = {"added_tokens_decoder": _added_tokens_decoder(tok), **config}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def make_bytelevel(seed: int = 0, vocab_size: int = 4096) -> Tokenizer:
    """Exactly the tokenizer ``tiny_model.make_tiny_model`` trains (same steps, same inputs)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed), trainer=trainer)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def make_metaspace(seed: int = 1, vocab_size: int = 2000) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in METASPACE_SPECIAL],
        limit_alphabet=200,
    )
    tok.train_from_iterator(generate_corpus(seed, n_lines=3000), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def main() -> int:
    bl = make_bytelevel()
    _write(BYTELEVEL_DIR, bl, {
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "clean_up_tokenization_spaces": False, "model_max_length": 16384,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
    })
    ms = make_metaspace()
    _write(METASPACE_DIR, ms, {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "unk_token": "<unk>", "pad_token": None, "legacy": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA2_CHAT_TEMPLATE,
    })
    for d, t in ((BYTELEVEL_DIR, bl), (METASPACE_DIR, ms)):
        size = (d / "tokenizer.json").stat().st_size
        print(f"{d.name}: vocab {t.get_vocab_size()}, tokenizer.json {size // 1024} KB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
