"""Hash and pick mode's figures for one body size: normalise, key and decide(), each adapter shape,
tenant isolation, and pick mode's choice (over a warm learned index, and for a new prompt on a
full one) with its parts."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from typing import Any

from extproc.adapters.ext_authz import PrefixAuthz
from extproc.adapters.ext_proc import PrefixRouter
from extproc.adapters.service import RouterService
from extproc.core.decide import decide, prefix_key
from extproc.core.normalize import normalize
from extproc.core.settings import RouteSettings
from extproc.pick.core import PickCore
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.views.learned import MAX_REQUEST_CHUNKS, LearnedView
from routerlab.bench.micro.adapters import (
    StubContext,
    adapter_once,
    check_message,
    check_once,
    http_check,
    http_server,
    wire_messages,
)
from routerlab.bench.micro.bodies import chat_body
from routerlab.bench.micro.timing import median_us

INDEX_CHUNKS = 50_000  # capacity of the full index the new-prompt column runs on


def unique_choice_us(size_kb: int, replicas: int, index_chunks: int, number: int) -> float:
    """Pick mode's worst case: every prompt new (its every chunk recorded, as many evicted),
    on an index already at its capacity of ``index_chunks`` chunks."""
    settings = RouteSettings(mode="pick")
    learned = LearnedView(index_max_chunks=index_chunks)
    core = PickCore(learned)
    core.set_endpoints([f"10.0.0.{i}:8000" for i in range(replicas)])
    seeds = iter(range(1, 1 << 30))

    def fresh() -> Any:
        seed = next(seeds)
        return decide(chat_body(size_kb * 1024, seed, marker=f"{seed:09d} "), {}, settings)

    while learned.index.stats().entries < index_chunks * 0.98:
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
    learned = core.view
    assert isinstance(learned, LearnedView)
    decision = decide(body, {}, pick_settings)
    chunks = chunk_hashes(decision.normalized, learned.chunk_bytes, MAX_REQUEST_CHUNKS)
    prefix = normalize(body, hash_settings.normalize).data[:hash_settings.prefix_length]

    def choice_once() -> None:
        core.release(core.pick(decision, pick_settings))

    service = RouterService(hash_settings)
    router = PrefixRouter(service)
    authz, check = PrefixAuthz(service), check_message(body)
    http, http_raw = http_server(service), http_check(body)
    wire, context = wire_messages(body), StubContext((("x-prefix-router-prefix-length", "4096"),
                                                   ("x-prefix-router-normalize", "prompt")))
    number = 2000 if size_kb <= 4 else 500
    return {
        "body_bytes": len(body),
        "normalize_us": round(median_us(lambda: normalize(body, hash_settings.normalize), number), 1),
        "key_us": round(median_us(lambda: prefix_key(None, prefix), number), 1),
        "hash_decide_us": round(median_us(lambda: decide(body, {}, hash_settings), number), 1),
        "adapter_us": round(median_us(lambda: adapter_once(router, wire, context), number), 1),
        "authz_adapter_us": round(median_us(lambda: check_once(authz, check, context), number), 1),
        "authz_http_us": round(median_us(lambda: http.data_received(http_raw), number), 1),
        "isolated_decide_us": round(median_us(lambda: decide(body, tenant, isolated, secret=secret), number), 1),
        "pick_choice_us": round(median_us(choice_once, number), 1),
        "pick_total_us": round(median_us(pick_once, number), 1),
        "chunk_hashes_us": round(median_us(
            lambda: chunk_hashes(decision.normalized, learned.chunk_bytes, MAX_REQUEST_CHUNKS), number), 1),
        "index_match_us": round(median_us(lambda: learned.index.match(chunks), number), 1),
        "pick_unique_us": round(unique_choice_us(size_kb, replicas, index_chunks, number // 4), 1),
        "chunks": len(chunks),
        "index_entries": learned.index.stats().entries,
    }
