"""Make a tiny random-weight Llama model directory offline, loadable by vLLM.

    /work/vllm-venv/bin/python -m routerlab.realvllm.tiny_model --out /tmp/tiny-llama

Everything is generated locally and seeded: a byte-level BPE tokenizer trained with the
``tokenizers`` library on generated pseudo-English text, a ``chat_template`` in
tokenizer_config.json, and ``LlamaForCausalLM(config).save_pretrained`` with random weights
(hidden 128, 2 layers, max_position_embeddings 16384 by default). The output is meant to
exercise the serving stack (prefix cache, scheduler, metrics), not to say anything sensible.

torch / transformers / tokenizers are imported lazily (inside :func:`make_tiny_model`): run
this module with a Python that has them, e.g. the vLLM venv's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from routerlab import LAB_DIR, REPO_DIR

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

MARKER = "tiny_model.json"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", MARKER)


def generate_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English text: syllable words, digits, punctuation, some code."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "pl", "ch", "sh", "th", "gr", "br"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck"]
    words = []
    for _ in range(3000):
        w = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                    for _ in range(rng.randint(1, 3)))
        words.append(w)
    # Zipf-ish: earlier words much more frequent.
    weights = [1.0 / (i + 1) for i in range(len(words))]
    lines = []
    for i in range(n_lines):
        kind = i % 10
        if kind == 7:
            name = rng.choice(words)
            lines.append(f"def {name}_{rng.randint(0, 99)}(x, y={rng.randint(0, 9)}):\n"
                         f"    return x * {rng.randint(1, 999)} + y  # {rng.choice(words)}")
        elif kind == 8:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)))
        else:
            n = rng.randint(5, 30)
            sent = rng.choices(words, weights=weights, k=n)
            sent[0] = sent[0].capitalize()
            lines.append(" ".join(sent) + rng.choice([".", ".", "?", "!", ",", ";"]))
    return lines


def is_complete(out: Path) -> bool:
    out = Path(out)
    return all((out / f).exists() for f in REQUIRED_FILES) and any(
        out.glob("*.safetensors")
    )


def ensure_tiny_model(out: Path, python: str) -> Path:
    """Make the model in ``out`` with ``python`` (the vLLM venv's, which has torch) unless it
    is already complete; this module runs there from the repository on PYTHONPATH."""
    out = Path(out)
    if is_complete(out):
        return out
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(LAB_DIR), env.get("PYTHONPATH")) if p)
    env.pop("VIRTUAL_ENV", None)
    subprocess.run([python, "-m", "routerlab.realvllm.tiny_model", "--out", str(out)],
                   check=True, env=env, cwd=str(REPO_DIR), timeout=900)
    return out


def make_tiny_model(
    out: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 4096,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 16384,
    dtype: str = "bfloat16",
    force: bool = False,
    sliding_window: int = 0,
) -> Path:
    """Write the model directory ``out``; returns it. Skips work if already complete.
    ``sliding_window`` > 0: a hybrid Gemma 3 text model instead (its layers alternate between
    sliding-window attention over that many tokens, first, and full attention), whose KV cache vLLM
    keeps in groups of each kind."""
    out = Path(out)
    if is_complete(out) and not force:
        return out
    # Lazy heavy imports: only this function needs them.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed), trainer=trainer)
    bos, eos = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in SPECIAL_TOKENS[:3])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=SPECIAL_TOKENS[2],
        model_max_length=max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Older/newer transformers store the template in different files; make sure
    # tokenizer_config.json carries it (vLLM reads it from there).
    cfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    if tcfg.get("chat_template") != CHAT_TEMPLATE:
        tcfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(tcfg, indent=2))

    real_vocab = tok.get_vocab_size()
    # Pad the embedding to a multiple of 64 (harmless, kernels like it).
    padded_vocab = (real_vocab + 63) // 64 * 64
    torch.manual_seed(seed)
    if sliding_window:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        hybrid = Gemma3TextConfig(
            vocab_size=padded_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            head_dim=hidden_size // num_heads, sliding_window=sliding_window,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
            max_position_embeddings=max_position_embeddings, query_pre_attn_scalar=hidden_size // num_heads,
            bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=True)
        hybrid.architectures = ["Gemma3ForCausalLM"]
        model = Gemma3ForCausalLM(hybrid)
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=padded_vocab,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            tie_word_embeddings=False,
            torch_dtype=dtype,
        ))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))

    (out / MARKER).write_text(json.dumps({
        "seed": seed,
        "tokenizer_vocab_size": real_vocab,
        "model_vocab_size": padded_vocab,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "dtype": dtype,
        "sliding_window": sliding_window,
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
    }, indent=2))
    return out


def model_info(out: str | Path) -> dict:
    """The marker written by :func:`make_tiny_model` (vocab sizes, special token ids)."""
    return json.loads((Path(out) / MARKER).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.tiny_model", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary target")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=16384)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    p.add_argument("--sliding-window", type=int, default=0,
                   help="make a hybrid Gemma 3 text model (layers alternating between sliding-window attention "
                        "over this many tokens, first, and full attention) with the same tokenizer")
    a = p.parse_args(argv)
    out = make_tiny_model(
        a.out, seed=a.seed, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
        num_layers=a.layers, max_position_embeddings=a.max_position_embeddings,
        dtype=a.dtype, force=a.force, sliding_window=a.sliding_window,
    )
    info = model_info(out)
    print(f"tiny model in {out}: vocab {info['tokenizer_vocab_size']} (embedding {info['model_vocab_size']}), "
          f"hidden {info['hidden_size']}, {info['num_layers']} layers", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
