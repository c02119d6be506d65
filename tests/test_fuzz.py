"""Hostile inputs through decide and the pick path (hypothesis), and the `fuzz` command itself.

test_core.py already covers arbitrary bytes, arbitrary JSON objects, the fixed chat body's
sampling/order invariance and the tenant and encoding tables; these go further: hostile
shapes and headers together, random chat bodies reordered at every level, property-based
tenant and compression rules, the pick path on any decision, and the command's report.
"""

from __future__ import annotations

import gzip
import json
import random
import string
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import cli
from extproc.core.decide import Decision, decide
from extproc.core.normalize import MODES, normalize
from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import REASONS
from extproc.pick.core import PickCore
from routerlab.fuzz import checks, documents, runner, shapes

from test_core import SAMPLING

FAST = settings(max_examples=300, deadline=None)

# --- strategies ------------------------------------------------------------------------
SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
HOSTILE_TEXT = st.text(max_size=30) | st.builds(str.__add__, st.text(max_size=8), SURROGATES)
PRINTABLE = st.text(st.sampled_from(string.printable), max_size=300)
LONG = st.builds(lambda n, c: c * n, st.integers(250, 100_000), st.sampled_from("a \x00é"))
TENANTS = HOSTILE_TEXT | PRINTABLE | LONG
KEYS = st.sampled_from(["model", "messages", "prompt", "content", "prompt_cache_key"]) | HOSTILE_TEXT
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | HOSTILE_TEXT,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(KEYS, kids, max_size=4),
    max_leaves=25,
)
TEXT_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40)}), min_size=1,
                      max_size=3)
IMAGE = st.just([{"type": "image_url", "image_url": {"url": "http://x/a.png"}}])
ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": ROLES, "content": st.text(max_size=80) | TEXT_PARTS | IMAGE},
    optional={"name": st.text(string.ascii_letters, max_size=6), "tool_call_id": st.just("c1")}),
    min_size=1, max_size=4)
CHAT_DOCS = st.fixed_dictionaries({"model": st.sampled_from(documents.MODELS), "messages": MESSAGES}, optional={
    "tools": st.just([{"type": "function", "function": {"name": "lookup"}}]), "cache_salt": st.text(max_size=8)})


@st.composite
def dumped(draw: st.DrawFn, docs: st.SearchStrategy[Any]) -> bytes:
    """A document as JSON with random escaping and whitespace (lone surrogates as CESU-8 or escapes)."""
    text = json.dumps(draw(docs), ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])))
    return text.encode("utf-8", "surrogatepass")


CHAT_BODIES = dumped(CHAT_DOCS)


@st.composite
def spliced(draw: st.DrawFn) -> bytes:
    """A chat body with a huge number, a NaN, a duplicate key or bad UTF-8 spliced in."""
    raw = draw(st.sampled_from(shapes.HUGE_NUMBERS + shapes.NON_FINITE
                               + (b'"dup"', b'[{"role":"user","content":"b"}]')))
    body = documents.with_raw_field(draw(CHAT_BODIES), draw(st.sampled_from(shapes.SPLICE_FIELDS)), raw)
    at = draw(st.integers(0, len(body)))
    return body[:at] + draw(st.sampled_from(shapes.BAD_UNICODE)) + body[at:] if draw(st.booleans()) else body


DEEP = st.builds(bytes.__mul__, st.sampled_from([b"[", b'{"a":', b'[{"messages":']), st.integers(1, 100_000))
BODIES = st.one_of(st.just(b""), st.binary(max_size=2048), dumped(JSON), CHAT_BODIES, spliced(), DEEP,
                   st.builds(bytes.__add__, st.just(b"\xef\xbb\xbf"), CHAT_BODIES))
HEADERS = st.fixed_dictionaries({}, optional={
    shapes.TENANT_HEADER: TENANTS, "x-amzn-sagemaker-prefix-aware-id": TENANTS,
    "content-encoding": st.sampled_from(["", "identity", " IDENTITY ", "gzip", " Deflate ", "br"])})
ROUTES = st.builds(RouteSettings, prefix_length=st.integers(64, 65536), normalize=st.sampled_from(MODES))


def _packed(payload: bytes, method: str) -> bytes:
    if method == "gzip":
        return gzip.compress(payload, mtime=0)
    if method == "zlib":
        return zlib.compress(payload)
    raw = zlib.compressobj(wbits=-15)
    return raw.compress(payload) + raw.flush()


def _shuffled_deep(value: Any, rng: random.Random) -> Any:
    """``value`` with every object's keys in a random order."""
    if isinstance(value, dict):
        items = [(k, _shuffled_deep(v, rng)) for k, v in value.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [_shuffled_deep(v, rng) for v in value]
    return value


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# --- decide ----------------------------------------------------------------------------
@FAST
@given(body=BODIES, headers=HEADERS, route=ROUTES, complete=st.booleans())
def test_hostile_requests_never_raise_and_decide_keeps_its_promises(body: bytes, headers: dict[str, str],
                                                                     route: RouteSettings, complete: bool) -> None:
    d = decide(body, headers, route, complete=complete)
    assert checks.differences(d, decide(body, headers, route, complete=complete)) == []  # deterministic
    assert (d.key is None) == (body == b"")
    assert d.prefix_bytes <= route.prefix_length
    assert checks.check(shapes.Case(body, headers, complete), route, d) == []


@FAST
@given(value=TENANTS, in_header=st.booleans(), doc=CHAT_DOCS)
def test_a_refused_tenant_routes_as_no_tenant(value: str, in_header: bool, doc: dict[str, Any]) -> None:
    plain = json.dumps(doc).encode()
    if in_header:
        body, headers = plain, {shapes.TENANT_HEADER: value}
    else:
        body, headers = json.dumps({**doc, "prompt_cache_key": value}).encode(), {}
    d = decide(body, headers, RouteSettings())
    sent = value if in_header else json.loads(body)["prompt_cache_key"]  # escaped surrogate pairs join
    if not in_header and not _is_utf8(sent):
        assert (d.tenant, d.fallback) == (None, "not_utf8")  # a lone surrogate: the body is unreadable
        return
    tenant, rejected = shapes.expected_tenant(sent)
    assert (d.tenant, d.tenant_rejected) == (tenant, rejected)
    if rejected:
        assert d.tenant_source is None and d.key == decide(plain, {}, RouteSettings()).key


@FAST
@given(payload=CHAT_BODIES | st.binary(min_size=1, max_size=512), method=st.sampled_from(["gzip", "zlib", "raw"]),
       header=st.sampled_from(["gzip", "deflate", "GZIP", " deflate ", "gzip, identity"]), route=ROUTES,
       complete=st.booleans())
def test_compressed_bodies_are_keyed_raw_and_never_decompressed(payload: bytes, method: str, header: str,
                                                               route: RouteSettings, complete: bool) -> None:
    packed = _packed(payload, method)
    d = decide(packed, {"content-encoding": header}, route, complete=complete)
    assert (d.normalize, d.fallback, d.tenant_source) == ("raw", "content_encoded", None)
    assert d.normalized == packed


@FAST
@given(doc=CHAT_DOCS, sampling=SAMPLING, order=st.randoms(use_true_random=False),
       indent=st.sampled_from([None, 0, 3]), ascii_only=st.booleans())
def test_normal_form_of_any_chat_body_ignores_sampling_key_order_and_whitespace(
        doc: dict[str, Any], sampling: dict[str, Any], order: random.Random, indent: int | None,
        ascii_only: bool) -> None:
    def form(value: Any, mode: str) -> bytes:
        return normalize(json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode(), mode).data

    base = json.dumps(doc).encode()
    assert form(_shuffled_deep({**doc, **sampling}, order), "prompt") == normalize(base, "prompt").data
    assert form(_shuffled_deep(doc, order), "canonical") == normalize(base, "canonical").data


# --- the pick path ---------------------------------------------------------------------
NO_FLEET = PickCore.from_state({"replicas": [{"address": "10.0.0.9:1", "healthy": False}]})
DECISIONS = st.builds(Decision, key=st.none() | st.text(max_size=20) | SURROGATES, tenant=st.none(),
                      tenant_source=st.none(), normalize=st.sampled_from(MODES), fallback=st.none(),
                      prefix_bytes=st.integers(0, 65536), normalized_bytes=st.integers(0, 10**6), preview=st.just(b""),
                      normalized=st.binary(max_size=8192), document=st.none())
PICK_ROUTES = st.builds(RouteSettings, mode=st.just("pick"), concurrency_threshold=st.integers(0, 16),
                        tie_tokens=st.integers(0, 4096), load_tokens=st.integers(0, 4096),
                        backlog_weight=st.floats(0, 4), stall_weight=st.floats(0, 4), max_num_seqs=st.integers(0, 300))


@FAST
@given(body=BODIES | CHAT_BODIES, headers=HEADERS, route=ROUTES, pick=PICK_ROUTES, built=DECISIONS,
       fleet=st.booleans())
def test_the_pick_path_never_raises_for_any_decision(body: bytes, headers: dict[str, str], route: RouteSettings,
                                                    pick: RouteSettings, built: Decision, fleet: bool) -> None:
    core = checks.pick_core() if fleet else NO_FLEET
    healthy = {r.address for r in core.load.snapshot().replicas if r.healthy}
    for decision in (decide(body, headers, route), built):
        choice, _ = core.evaluate(decision, pick)
        assert choice.reason in REASONS and (choice.address in healthy or choice.address is None)
        assert (choice.address is None) == (not healthy)


@settings(max_examples=200, deadline=None)
@given(shape=st.sampled_from(sorted(shapes.SHAPES)), seed=st.integers(0, 2**32), turn=st.integers(0, 400),
       mode=st.sampled_from(MODES), limit=st.sampled_from([shapes.DEFAULT_MAX_BODY_BYTES, 4096]))
def test_every_fuzz_shape_keeps_decides_promises(shape: str, seed: int, turn: int, mode: str, limit: int) -> None:
    case = shapes.fit(shapes.SHAPES[shape](shapes.FuzzRandom(seed, turn), limit), limit)
    route = RouteSettings(normalize=mode, prefix_length=64 + seed % 65473)
    assert len(case.body) <= limit
    assert checks.check(case, route, decide(case.body, case.headers, route, complete=case.complete)) == []


# --- the command -----------------------------------------------------------------------
def _fuzz_command(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str,
                  bodies: int = 300) -> tuple[int, dict[str, Any]]:
    rc = cli.main(["fuzz", "--bodies", str(bodies), "--json", "--seed", "5", "--save-failures", str(tmp_path),
                   *flags])
    return rc, json.loads(capsys.readouterr().out)


def test_fuzz_command_reports_every_shape_and_passes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, report = _fuzz_command(capsys, tmp_path)
    assert report["failure_kinds"] == {} and report["violations"] == 0 and report["exceptions"] == 0
    assert rc == 0
    assert set(report) == set(runner.REPORT_KEYS) and report["bodies"] == 300
    assert set(report["shapes"]) == set(shapes.SHAPES) and all(s["count"] > 0 for s in report["shapes"].values())
    assert sum(s["count"] for s in report["shapes"].values()) == 300
    assert sum(report["pick_reasons"].values()) > 0 and report["fallbacks"]["content_encoded"] > 0
    assert 0 < report["p99_ms"] <= report["max_ms"] and report["max_ms_per_mib"] > 0
    assert report["peak_rss_mib"] >= report["rss_before_mib"] > 0
    outcomes = report["precise"]["outcomes"]
    assert report["precise"]["bodies"] >= 4 * 13 and outcomes["bytelevel:exact"] > 0 and outcomes["metaspace:exact"] > 0
    assert {"bytelevel:not_json", "bytelevel:bad_request", "metaspace:tokenizer_mismatch"} <= set(outcomes)
    assert cli.main(["fuzz", "--bodies", "40", "--save-failures", ""]) in (0, 1)
    assert "hostile_tenant" in capsys.readouterr().out  # the table


def test_fuzz_command_fails_when_decide_raises(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    real = runner.decide

    def broken(body: bytes, *args: Any, **kwargs: Any) -> Decision:
        if not body:  # the "empty" shape only
            raise ValueError("boom")
        return real(body, *args, **kwargs)

    monkeypatch.setattr(runner, "decide", broken)
    rc, report = _fuzz_command(capsys, tmp_path)
    empty = report["shapes"]["empty"]
    assert rc == 1 and report["failures_by_stage"]["decide"] == empty["count"] == empty["failures"] > 0
    first = next(e for e in report["examples"] if e["stage"] == "decide")
    assert (first["shape"], first["stage"], first["error"]) == ("empty", "decide", "ValueError('boom')")
    assert first["where"].endswith("in broken") and first["body"] > 0
    saved = json.loads(Path(first["reproducer"]).read_text())
    assert (saved["seed"], saved["body"], saved["shape"], saved["body_base64"]) == (5, first["body"], "empty", "")
    assert "ValueError: boom" in saved["traceback"]
    assert cli.main(["fuzz", "--replay", first["reproducer"]]) == 1  # the reproducer reproduces
    assert json.loads(capsys.readouterr().out)["examples"][0]["error"] == "ValueError('boom')"
    monkeypatch.setattr(runner, "decide", real)
    assert cli.main(["fuzz", "--replay", first["reproducer"]]) == 0  # and passes once fixed
    capsys.readouterr()


def test_fuzz_command_fails_when_a_promise_breaks(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    real = runner.decide

    def decompressing(*args: Any, **kwargs: Any) -> Decision:
        return real(*args, **kwargs)._replace(fallback=None)  # claims it parsed the body

    monkeypatch.setattr(runner, "decide", decompressing)
    rc, report = _fuzz_command(capsys, tmp_path)
    assert rc == 1 and report["failures_by_stage"].get("decide", 0) == 0
    assert report["shapes"]["compressed"]["failures"] == report["shapes"]["compressed"]["count"]
    assert any("content-encoded body is keyed raw" in e["error"] for e in report["examples"])


def test_no_reproducer_is_written_unless_asked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    rc, report = _fuzz_command(capsys, tmp_path / "unused", "--save-failures", "", bodies=44)
    assert all("reproducer" not in e for e in report["examples"]) and list(tmp_path.iterdir()) == []


# --- the deep body that broke the determinism check, and a run that meets every variant ---------
DEEP_CONTENT = b'{"model":"m","messages":[{"role":"user","content":%s}]}'


@pytest.mark.parametrize("depth", [1018, 1020])
@pytest.mark.parametrize("mode", MODES)
def test_the_deep_body_that_broke_the_determinism_check(depth: int, mode: str) -> None:
    """``prefix-router fuzz`` died at ~1,000 bodies: ``again != d`` on a Decision whose document holds
    this 1,021-deep content raised RecursionError in the comparison itself."""
    body = DEEP_CONTENT % (b"[" * depth + b"]" * depth)
    assert body in shapes._deep_bodies(shapes.DEFAULT_MAX_BODY_BYTES)  # the deep_nesting shape's own body
    route = RouteSettings(normalize=mode, mode="pick")
    d, again = decide(body, {}, route), decide(body, {}, route)
    if d.document is not None:
        with pytest.raises(RecursionError):
            _ = d == again  # why the check no longer compares decisions with ==
    assert checks.differences(d, again) == []
    run = runner.Run()
    case = shapes.Case(body)
    runner._try(run, runner.Body(1, "deep_nesting", 10, case, route, pick=True, precise=False))
    assert (run.exceptions, run.violations, run.examples) == (0, 0, [])


def test_each_shape_meets_all_its_variants_in_as_many_rounds() -> None:
    limit = shapes.DEFAULT_MAX_BODY_BYTES
    deep = {shapes.SHAPES["deep_nesting"](shapes.FuzzRandom(0, turn), limit).body for turn in range(13)}
    assert deep == set(shapes._deep_bodies(limit))
    wide = [len(shapes.SHAPES["wide"](shapes.FuzzRandom(0, turn), limit).body) for turn in range(4)]
    assert [round(n / shapes.MIB, 2) for n in wide] == [round(s / shapes.MIB, 2) for s in shapes.WIDE_SIZES]
    rng = shapes.FuzzRandom(0)
    seen = set()
    for rng.turn in range(3 * 4):
        seen.add((shapes.cycle(rng, "abc"), shapes.cycle(rng, "wxyz", every=3)))
    assert len(seen) == 12  # two cycles with every=len(first) meet in every combination


@pytest.mark.parametrize("field", ["document", "key"])
def test_the_determinism_check_still_fails_a_nondeterministic_decide(monkeypatch: pytest.MonkeyPatch,
                                                                     field: str) -> None:
    real, calls = runner.decide, iter(range(10**6))
    deep = DEEP_CONTENT % (b"[" * 1018 + b"]" * 1018)

    def drifting(*args: Any, **kwargs: Any) -> Decision:
        d = real(*args, **kwargs)
        n = next(calls)
        if field == "key":
            return d._replace(key=f"{n:016x}")
        inner = orjson.loads(b"[" * 1000 + str(n).encode() + b"]" * 1000)  # the difference 1,000 levels down
        return d._replace(document={**(d.document or {}), "x": inner})

    monkeypatch.setattr(runner, "decide", drifting)
    run = runner.Run()
    route = RouteSettings(mode="pick")
    runner._try(run, runner.Body(1, "deep_nesting", 0, shapes.Case(deep), route, pick=True, precise=False))
    assert run.violations == 1 and run.exceptions == 0
    assert f"decide is deterministic ({field} differs)" in run.examples[0]["error"]


def test_same_json_is_exact_and_iterative() -> None:
    deep = orjson.loads(b"[" * 1024 + b"]" * 1024)
    assert checks.same_json(deep, orjson.loads(b"[" * 1024 + b"]" * 1024))
    assert not checks.same_json(deep, orjson.loads(b"[" * 1023 + b"1" + b"]" * 1023))
    assert not checks.same_json({"a": 1, "b": 2}, {"b": 2, "a": 1})  # the template sees the order
    assert not checks.same_json([1], [1.0]) and not checks.same_json([1], [True])
    assert checks.same_document({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]})
    assert not checks.same_document({"a": 1}, {"a": 1.0}) and not checks.same_document({"a": deep}, {"a": [deep]})


@pytest.mark.slow
def test_a_long_fuzz_run_meets_every_variant_and_holds(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    """510 rounds of the 22 shapes (11,220 bodies, ~20 s): every shape's every cycled variant twice, the
    deep ones included (the 300-body run above sees 13 rounds), the determinism check on each of them,
    and round 500, where the large bodies (1 MiB strings, up to 8 MiB of tiny containers) go through
    precise mode too."""
    from routerlab.fuzz import hostile_docs

    rounds = 510
    rc, report = _fuzz_command(capsys, tmp_path, bodies=rounds * len(shapes.SHAPES))
    assert report["failure_kinds"] == {} and report["violations"] == 0 and report["exceptions"] == 0 and rc == 0
    variants = {"deep_nesting": 13, "bad_unicode": len(shapes.BAD_UNICODE) * 4,
                "precise_messages": len(hostile_docs.MESSAGE_EDITS), "precise_request": len(hostile_docs.DOC_EDITS),
                "precise_completions": len(hostile_docs.COMPLETIONS_EDITS),
                "precise_deep": len(hostile_docs.DEEP_CASES)}
    assert all(report["shapes"][shape]["count"] >= 2 * n for shape, n in variants.items())
    assert report["shapes"]["wide"]["max_bytes"] >= shapes.DEFAULT_MAX_BODY_BYTES - 64
    assert report["fallbacks"]["too_deep"] > 0 and report["precise"]["bodies"] >= 4 * rounds
