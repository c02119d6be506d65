"""`prefix-router microbench`: the router's own work per request, without gRPC or Envoy.

Times the pure core on chat bodies of several sizes (2, 4 and 32 KB by default): hash
mode's ``decide`` and its two parts, normalise (parse + normal form) and key (xxh3 of the
prefix); the same with tenant isolation (HMAC salt and body edit); pick mode's choice
alone (chunk hashes, index match over a warm index, the cost ranking, recording the
pick) and with its ``decide``. Medians of repeated runs, in microseconds; compare the rows
of one run, not runs across machines. The whole hop (gRPC, Envoy) is ``prefix-router
bench --scenario overhead``, which sends bodies from the same ``chat_body``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import timeit
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

from envoy.service.auth.v3 import external_auth_pb2 as authz_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.ext_authz import PrefixAuthz
from extproc.adapters.ext_authz_http import HttpAuthz
from extproc.adapters.ext_proc import PrefixRouter
from extproc.core.decide import decide, prefix_key
from extproc.core.normalize import normalize
from extproc.core.settings import RouteSettings
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.core import MAX_REQUEST_CHUNKS, PickCore
from extproc.pick.events.kv_events import BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.views.precise import PreciseView
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.process.http1 import Http1Protocol
from routerlab.assets import TINY_BYTELEVEL
from routerlab.harness.extproc_messages import body_message, headers_message

SIZES_KB = (2, 4, 32)
INDEX_CHUNKS = 50_000  # capacity of the full index the new-prompt column runs on
IN_FLIGHT: Final = 48  # precise mode's requests of ours in flight for the loaded column (kv-pressure's)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_KB)), help="body sizes in KB (comma list)")
    parser.add_argument("--replicas", type=int, default=8, help="replicas in pick mode's warm index")
    parser.add_argument("--warm-prompts", type=int, default=2000, help="prompts recorded into the index first")
    parser.add_argument("--index-chunks", type=int, default=INDEX_CHUNKS,
                        help="capacity of the full index the unique-prompt column runs on")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def chat_body(size: int, seed: int, marker: str = "", model: str = "llama") -> bytes:
    """A chat body of about ``size`` bytes: a shared system prompt and a distinct question.

    ``marker`` starts the system prompt (the overhead scenario puts a per-request id there,
    inside the hashed prefix, so no two requests share a key).
    """
    rng = random.Random(seed)
    words = "the cache token prefix route replica envoy model server request latency".split()
    question = " ".join(rng.choices(words, k=max(8, size // 70)))
    shell = {"model": model, "messages": [{"role": "system", "content": marker},
                                          {"role": "user", "content": question}],
             "temperature": 0.2, "stream": True}
    filler = max(0, size - len(json.dumps(shell)))
    shell["messages"][0]["content"] = marker + ("You are a helpful assistant. " * (filler // 29 + 1))[:filler]
    return json.dumps(shell).encode()


# What Envoy 1.40 sends with envoy.yaml for a wrk request (Envoy adds the x-forwarded-* and x-request-id),
# content-length aside.
_WIRE_HEADERS = (":authority", "127.0.0.1:10000"), (":path", "/v1/chat/completions"), (":method", "POST"), \
    (":scheme", "http"), ("content-type", "application/json"), \
    ("x-forwarded-proto", "http"), ("x-request-id", "5b0c8f0e-4d1e-4f7a-9d7b-0a3c2f1e6d5c")


class _Context:
    """The one thing the adapter asks of grpc's ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def wire_messages(body: bytes) -> list[bytes]:
    """envoy.yaml's two ext_proc messages for one request, serialised as Envoy sends them."""
    headers = headers_message((*_WIRE_HEADERS, ("content-length", str(len(body)))))
    return [headers.SerializeToString(), body_message(body).SerializeToString()]


def check_message(body: bytes) -> bytes:
    """envoy-fast.yaml's one Check for the same request (allowed_headers: none of wrk's are sent)."""
    message = authz_pb.CheckRequest()
    http = message.attributes.request.http
    http.method, http.path, http.host, http.protocol = "POST", "/v1/chat/completions", "127.0.0.1:10000", "HTTP/1.1"
    http.size, http.raw_body = len(body), body
    return message.SerializeToString()


def check_once(authz: PrefixAuthz, raw: bytes, context: _Context) -> int:
    """The ext_authz shape's adapter: parse the Check, answer it, serialise the answer."""
    return len(authz.check(authz_pb.CheckRequest.FromString(raw), context.invocation_metadata()).SerializeToString())


def http_check(body: bytes) -> bytes:
    """envoy-fast.yaml's HTTP check for the same request, as Envoy 1.40 sends it (its listener-wide settings
    as headers, the partial-body flag, the declared length)."""
    head = ("POST /check/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:10000\r\n"
            f"content-length: {len(body)}\r\nx-prefix-router-prefix-length: 4096\r\n"
            "x-prefix-router-normalize: prompt\r\nx-envoy-auth-partial-body: false\r\n"
            f"x-prefix-declared-length: {len(body)}\r\nx-envoy-internal: true\r\n"
            "x-envoy-expected-rq-timeout-ms: 500\r\n\r\n")
    return head.encode() + body


class _Sink:
    """A transport that keeps only the number of bytes written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)


def http_server(router: PrefixRouter) -> Http1Protocol:
    """The HTTP port's connection code (extproc.process.http1) with the adapter, on a transport that writes nowhere."""
    authz = HttpAuthz(router)
    server = type("Server", (), {"connections": set(), "now": staticmethod(lambda: 0.0),
                                 "handler": staticmethod(lambda r: (200, authz.answer(r.headers, r.body, r.cut)))})()
    protocol = Http1Protocol(server)  # type: ignore[arg-type]
    protocol.connection_made(_Sink())  # type: ignore[arg-type]
    return protocol


def adapter_once(router: PrefixRouter, wire: list[bytes], context: _Context) -> int:
    """One request through the adapter as grpc drives it (parse, Process, serialise), minus the I/O.

    The request iterator never waits, so the async generator runs to its end without a loop.
    """
    async def requests():  # type: ignore[no-untyped-def]
        for raw in wire:
            yield pb.ProcessingRequest.FromString(raw)

    stream = router.Process(requests(), context)  # type: ignore[arg-type]
    sent = 0
    while True:
        try:
            stream.__anext__().send(None)
        except StopIteration as reply:
            sent += len(reply.value.SerializeToString())
        except StopAsyncIteration:
            return sent


REPEAT: Final = 7


def _median_us(fn: Callable[[], object], number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=REPEAT)) / number * 1e6


def _interleaved_us(*fns: Callable[[], object], number: int) -> tuple[float, ...]:
    """``_median_us`` of each variant, their repeats alternated (a shared machine drifts)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(REPEAT):
        for fn, out in zip(fns, times):
            out.append(timeit.timeit(fn, number=number) / number * 1e6)
    return tuple(statistics.median(t) for t in times)


def unique_choice_us(size_kb: int, replicas: int, index_chunks: int, number: int) -> float:
    """Pick mode's worst case: every prompt new (its every chunk recorded, as many evicted),
    on an index already at its capacity of ``index_chunks`` chunks."""
    settings = RouteSettings(mode="pick")
    core = PickCore(index_max_chunks=index_chunks)
    core.set_endpoints([f"10.0.0.{i}:8000" for i in range(replicas)])
    seeds = iter(range(1, 1 << 30))

    def fresh() -> Any:
        seed = next(seeds)
        return decide(chat_body(size_kb * 1024, seed, marker=f"{seed:09d} "), {}, settings)

    while core.index.stats().entries < index_chunks * 0.98:
        core.release(core.pick(fresh(), settings))
    runs = []
    for _ in range(5):
        batch = [fresh() for _ in range(number)]
        start = timeit.default_timer()
        for d in batch:
            core.release(core.pick(d, settings))
        runs.append((timeit.default_timer() - start) / number * 1e6)
    return statistics.median(runs)


def pick_request(size_kb: int, replicas: int, warm_prompts: int) -> tuple[PickCore, Callable[[], None]]:
    """Pick mode over ``replicas`` addresses, its learned index warmed with ``warm_prompts`` other
    prompts (some sharing the system prompt), and one request's decide() + choice on it."""
    size, settings = size_kb * 1024, RouteSettings(mode="pick")
    body = chat_body(size, 0)
    core = PickCore()
    core.set_endpoints([f"10.0.0.{i}:8000" for i in range(replicas)])
    for i in range(warm_prompts):
        core.release(core.pick(decide(chat_body(size, i + 1), {}, settings), settings))

    def pick_once() -> None:
        core.release(core.pick(decide(body, {}, settings), settings))
    return core, pick_once


def measure(size_kb: int, replicas: int, warm_prompts: int, index_chunks: int = INDEX_CHUNKS,
            pick: tuple[PickCore, Callable[[], None]] | None = None) -> dict[str, Any]:
    """Hash and pick mode's figures at ``size_kb`` (``pick``: ``pick_request``'s, if made already)."""
    size = size_kb * 1024
    body = chat_body(size, 0)
    hash_settings, pick_settings = RouteSettings(), RouteSettings(mode="pick")
    isolated, secret, tenant = RouteSettings(tenant_isolation=True), b"microbench-secret-0123456789", {
        "x-prefix-aware-id": "acme"}
    core, pick_once = pick or pick_request(size_kb, replicas, warm_prompts)
    decision = decide(body, {}, pick_settings)
    chunks = chunk_hashes(decision.normalized, core.chunk_bytes, MAX_REQUEST_CHUNKS)
    prefix = normalize(body, hash_settings.normalize).data[:hash_settings.prefix_length]

    def choice_once() -> None:
        core.release(core.pick(decision, pick_settings))

    router = PrefixRouter(hash_settings)
    authz, check = PrefixAuthz(router), check_message(body)
    http, http_raw = http_server(router), http_check(body)
    wire, context = wire_messages(body), _Context((("x-prefix-router-prefix-length", "4096"),
                                                   ("x-prefix-router-normalize", "prompt")))
    number = 2000 if size_kb <= 4 else 500
    return {
        "body_bytes": len(body),
        "normalize_us": round(_median_us(lambda: normalize(body, hash_settings.normalize), number), 1),
        "key_us": round(_median_us(lambda: prefix_key(None, prefix), number), 1),
        "hash_decide_us": round(_median_us(lambda: decide(body, {}, hash_settings), number), 1),
        "adapter_us": round(_median_us(lambda: adapter_once(router, wire, context), number), 1),
        "authz_adapter_us": round(_median_us(lambda: check_once(authz, check, context), number), 1),
        "authz_http_us": round(_median_us(lambda: http.data_received(http_raw), number), 1),
        "isolated_decide_us": round(_median_us(lambda: decide(body, tenant, isolated, secret=secret), number), 1),
        "pick_choice_us": round(_median_us(choice_once, number), 1),
        "pick_total_us": round(_median_us(pick_once, number), 1),
        "chunk_hashes_us": round(_median_us(
            lambda: chunk_hashes(decision.normalized, core.chunk_bytes, MAX_REQUEST_CHUNKS), number), 1),
        "index_match_us": round(_median_us(lambda: core.index.match(chunks), number), 1),
        "pick_unique_us": round(unique_choice_us(size_kb, replicas, index_chunks, number // 4), 1),
        "chunks": len(chunks),
        "index_entries": core.index.stats().entries,
    }


class _Live:
    origin = "events"


QUESTION_WORDS: Final = "which replica holds my prompt and how long until the first token arrives".split()


def questions(system: str, n: int, seed: int = 1, first: int = 0) -> list[bytes]:
    """``n`` chat bodies sharing the system prompt ``system``, each with its own 30-word question
    ending in its number (from ``first``: a word no other question has)."""
    rng = random.Random(seed)
    return [json.dumps({"model": "llama", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": " ".join(rng.choices(QUESTION_WORDS, k=30)) + f" ({i})"}]}).encode()
        for i in range(first, first + n)]


def precise_core(tokenizer: ModelTokenizer, replicas: int, held: Sequence[int], block_size: int = 16) -> PickCore:
    """Pick mode in precise mode over ``replicas`` addresses, all covered by events, the first half
    holding the full blocks of the token ids ``held``."""
    index = EventIndex()
    addresses = [f"10.0.0.{i}:8000" for i in range(replicas)]
    core = PickCore()
    core.set_endpoints(addresses)
    core.precise = PreciseView(index, {"*": tokenizer}, {a: _Live() for a in addresses})
    full = len(held) // block_size * block_size
    for i, address in enumerate(addresses[: replicas // 2]):
        hashes = [(i << 32) + n for n in range(full // block_size)]
        index.apply(address, [BlockStored(tuple(hashes), None, tuple(held[:full]), block_size)])
    return core


MAX_WARM: Final = 20_000  # requests at most to bring the prompt memo to its bound
WARM_NUMBERS: Final = 10_000_000  # the warm-up's questions are numbered (and seeded) from here, the timed ones' below


def fill_memo(core: PickCore, tokenizer: ModelTokenizer, system: str, settings: RouteSettings) -> int:
    """Route new questions on ``system`` until the tokenizer's prompt memo holds its bound, as a
    router that has run a while does (pick mode's row warms its index likewise); returns how many.

    Timed from an empty memo, every request's text is new memory the memo keeps: until the memo is
    full (about 500 requests at 32 KB) each pays the heap's growth (5.5 minor page faults a request
    at 32 KB, measured here), which a running router, evicting as much as it files, does not. The
    warm-up's questions carry numbers the timed ones do not, so every timed question still has a
    word the word cache has not seen."""
    memo, n = tokenizer.memo, 0
    while memo is not None and memo.bytes < 0.95 * memo.max_bytes and n < MAX_WARM:
        for body in questions(system, 200, seed=WARM_NUMBERS + n, first=WARM_NUMBERS + n):
            core.release(core.pick(decide(body, {}, settings), settings))
        n += 200
    return n


def precise_measure(size_kb: int, replicas: int, block_size: int = 16,
                    pick_once: Callable[[], None] | None = None) -> dict[str, Any]:
    """Precise mode (the tiny byte-level tokenizer): decide + the choice for requests that share a
    system prompt already tokenised once (only their new question is tokenised), with half the
    replicas holding the prompt's blocks in the event view; and the cold tokenisation of one.
    ``pick_once`` (``pick_request``'s): pick mode's decide() + choice, timed interleaved with
    precise mode's for their ratio (``precise_over_pick``)."""
    settings = RouteSettings(mode="pick")
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    system = json.loads(chat_body(size_kb * 1024, 0))["messages"][0]["content"]  # one system prompt for all
    number = 200 if size_kb <= 4 else 50
    bodies = questions(system, 3 * REPEAT * number + IN_FLIGHT + 1)  # a new question for every request timed
    ids = tokenizer.token_array(json.loads(bodies[0]), "chat")  # as precise mode gets them
    full = len(ids) // block_size * block_size
    core = precise_core(tokenizer, replicas, ids.tolist(), block_size)
    warmed = fill_memo(core, tokenizer, system, settings)
    requests = iter(bodies[1:])
    docs = [json.loads(b) for b in bodies[:400]]
    words = tokenizer.words

    def pick_new(word_cache: bool) -> Callable[[], None]:
        def once() -> None:
            tokenizer.words = words if word_cache else None
            core.release(core.pick(decide(next(requests), {}, settings), settings))
        return once

    def cold() -> None:
        tokenizer.clear_cache()
        tokenizer.tokens_for(docs[0], "chat")

    in_flight: deque[Any] = deque()

    def pick_loaded() -> None:  # each pick ends the oldest of IN_FLIGHT requests in flight
        in_flight.append(core.pick(decide(next(requests), {}, settings), settings))
        if len(in_flight) > IN_FLIGHT:
            core.release(in_flight.popleft())

    warm_docs = iter(docs * 50)
    variants = (pick_new(True), pick_new(False)) + ((pick_once,) if pick_once is not None else ())
    total, without_words, *pick = _interleaved_us(*variants, number=number)
    tokenizer.words = words
    for _ in range(IN_FLIGHT):
        pick_loaded()
    loaded = _median_us(pick_loaded, number)
    while in_flight:
        core.release(in_flight.popleft())
    out = {
        "precise_total_us": total,
        "precise_total_no_words_us": without_words,
        "precise_in_flight_us": loaded,
        "precise_tokenize_us": _median_us(lambda: tokenizer.token_array(next(warm_docs), "chat"), number),
        "precise_hash_us": _median_us(lambda: core.precise.chains.hashes(ids[:full], block_size), number),
        "precise_tokenize_cold_us": _median_us(cold, max(5, number // 10)),
        "prompt_tokens": len(ids),
        "warm_requests": warmed,
    }
    rounded = {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}
    if pick:
        rounded["precise_over_pick"] = round(total / pick[0], 2)
    return rounded


CONVERSATIONS: Final = 32  # conversations in flight on one system prompt (the turns table)
TURNS: Final = (10, 40)
TURN_REQUESTS: Final = 10  # requests a repeat of the turns table times (7 repeats, two variants)


def conversation_bodies(turns: int, extra: int, seed: int = 3) -> tuple[list[bytes], list[bytes]]:
    """``CONVERSATIONS`` conversations on one 8 KB system prompt, taken in turn: the bodies that
    bring each to ``turns`` turns, then ``extra`` more next turns (30-word questions, 60-word
    answers)."""
    rng = random.Random(seed)
    system = json.loads(chat_body(8 * 1024, 0))["messages"][0]["content"]
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for _ in range(CONVERSATIONS)]
    bodies = []
    for t in range(turns * CONVERSATIONS + extra):
        conv = convs[t % CONVERSATIONS]
        conv.append({"role": "user", "content": " ".join(rng.choices(QUESTION_WORDS, k=30))})
        bodies.append(json.dumps({"model": "llama", "messages": conv}).encode())
        conv.append({"role": "assistant", "content": " ".join(rng.choices(QUESTION_WORDS, k=60))})
    return bodies[:turns * CONVERSATIONS], bodies[turns * CONVERSATIONS:]


def precise_turns(turns: int, replicas: int) -> dict[str, Any]:
    """Precise mode's decide + choice for a conversation's next turn, every earlier turn seen, with
    the prompt memo and without it (each with its own tokenizer, their repeats interleaved)."""
    settings = RouteSettings(mode="pick")
    warm, timed = conversation_bodies(turns, 2 * REPEAT * TURN_REQUESTS)
    variants = []
    for memo in (True, False):
        tokenizer = ModelTokenizer(TINY_BYTELEVEL)
        if not memo:
            tokenizer.memo = None
        core = precise_core(tokenizer, replicas, tokenizer.token_array(json.loads(warm[0]), "chat").tolist())
        for body in warm:
            core.release(core.pick(decide(body, {}, settings), settings))
        bodies = iter(timed)

        def once(core: PickCore = core, bodies: Any = bodies) -> None:
            core.release(core.pick(decide(next(bodies), {}, settings), settings))
        variants.append(once)
    with_memo, without = _interleaved_us(*variants, number=TURN_REQUESTS)
    return {"turns": turns, "body_bytes": len(timed[0]), "memo_us": round(with_memo, 1),
            "no_memo_us": round(without, 1)}


def run(args: argparse.Namespace) -> int:
    rows = []
    for kb in (int(kb) for kb in args.sizes.split(",") if kb.strip()):
        pick = pick_request(kb, args.replicas, args.warm_prompts)  # one warmed core: both tables time it
        rows.append({**measure(kb, args.replicas, args.warm_prompts, args.index_chunks, pick),
                     **precise_measure(kb, args.replicas, pick_once=pick[1])})
    turns = [precise_turns(n, args.replicas) for n in TURNS]
    if args.json:
        print(json.dumps({"sizes": rows, "turns": turns}, indent=2))
        return 0
    print(f"router's own work per request, median us ({args.replicas} replicas, index warmed with "
          f"{args.warm_prompts} prompts)\n")
    print("| body | normalise | key | hash mode: decide() | adapter: ext_proc (envoy.yaml) | "
          "adapter: ext_authz gRPC Check | adapter: ext_authz over HTTP (envoy-fast.yaml) | with tenant isolation | pick mode: the choice | "
          "pick mode: decide() + choice | of which chunk hashes | of which index match | "
          "pick mode: the choice for a new prompt on a full index | chunks |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['body_bytes'] / 1024:.1f} KB | {r['normalize_us']} | {r['key_us']} | {r['hash_decide_us']} | "
              f"{r['adapter_us']} | {r['authz_adapter_us']} | {r['authz_http_us']} | {r['isolated_decide_us']} | {r['pick_choice_us']} | {r['pick_total_us']} | "
              f"{r['chunk_hashes_us']} | {r['index_match_us']} | {r['pick_unique_us']} | {r['chunks']} |")
    print("\nnormalise: parse + normal form (prompt mode); key: xxh3-64 of the first prefix_length (4096) bytes; "
          "decide(): both, plus the tenant; adapter: the request's messages parsed, the adapter run "
          "(decide() included, metrics too) and its replies serialised, as grpc does it but with no I/O "
          "(ext_proc: two messages in, two replies out; ext_authz: one Check in, one answer out); "
          "over HTTP: the check request's bytes parsed (httptools), answered and the answer written, by the "
          "HTTP port's own connection code; "
          "the choice: pick mode on an already decided body; "
          f"a new prompt on a full index: its chunks all recorded and as many evicted ({args.index_chunks} chunks held)")
    print("\nprecise mode (the tiny byte-level tokenizer, half the replicas holding the system prompt in the "
          "event view):\n")
    print("| body | prompt tokens | decide() + choice, system prompt tokenised before, a new question | "
          "the same over pick mode's decide() + choice | "
          f"the same without the word cache | the same with {IN_FLIGHT} of ours in flight | of which render + tokenise (question seen) | of which block hashes "
          "(span cache warm) | cold render + tokenise |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['body_bytes'] / 1024:.1f} KB | {r['prompt_tokens']} | {r['precise_total_us']} | "
              f"{r['precise_over_pick']:.2f} | "
              f"{r['precise_total_no_words_us']} | {r['precise_in_flight_us']} | {r['precise_tokenize_us']} | {r['precise_hash_us']} | "
              f"{r['precise_tokenize_cold_us']} |")
    warm = ", ".join(f"{r['warm_requests']} at {r['body_bytes'] / 1024:.1f} KB" for r in rows if "warm_requests" in r)
    print("\nover pick mode: the two timed in alternation in one process, pick mode's request as in the first "
          "table (the machine's speed drifts between runs: the issue's target, 100 us at 32 KB when pick mode "
          f"took 54 us, is a ratio of 1.85); timed after other new questions filled the prompt memo ({warm}), as "
          "in a router that has run a while")
    print(f"\nprecise mode, a conversation's next turn ({CONVERSATIONS} conversations on one 8 KB system prompt, "
          "every earlier turn seen; 30-word questions, 60-word answers):\n")
    print("| turns before | body | decide() + choice | the same without the prompt memo |")
    print("|---:|---:|---:|---:|")
    for t in turns:
        print(f"| {t['turns']} | {t['body_bytes'] / 1024:.1f} KB | {t['memo_us']} | {t['no_memo_us']} |")
    return 0
