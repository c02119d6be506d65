"""vLLM's counters from a Prometheus server's HTTP API, for operators who cannot reach every replica.

On Kubernetes the tool rarely reaches each vLLM pod's /metrics, but a Prometheus server scrapes
them. ``PrometheusSource`` reads, at each window edge, the same counters ``counters.scrape``
reads from /metrics, as the same ``counters.Snapshot`` (one entry per replica), so the windows
file, ``counters.delta`` and ``analyze`` are the /metrics path's, unchanged:

- a replica is a scrape target: the series of one ``instance`` (summed over their other labels,
  ``model_name``, ``engine``..., as /metrics sums its samples); a pool is a label matcher;
- each edge is an instant query *at the edge's timestamp*, asked once every scrape that began
  before the edge has landed (``settle``), so a late query reads the same instant;
- resets are ``counters.delta``'s: a counter that went down between two edges restarted, and
  the window counts its value after the restart. ``increase()`` is not used: it extrapolates to
  the window's ends and sees every scrape in between, so its numbers would not be those the
  /metrics path records for the same run;
- staleness: a target that stopped answering has a staleness marker, so its series are gone from
  the instant query (the replica is missing at that edge); a series whose last sample is older than
  ``STALE_INTERVALS`` scrape intervals at the edge (no marker, e.g. Prometheus restarted) is
  unreadable there, never carried forward.

The scrape interval is measured from the series' own samples (no access to the targets API
needed, which Thanos or Mimir do not serve). A window must hold two scrapes.

Credentials (``Server``): a Prometheus behind basic auth (its ``--web.config.file``) or a proxy
that wants a bearer token (Thanos, Mimir, a gateway) gets an ``Authorization`` header on every
query, from ``user:password@`` in the URL or from a file (``--prometheus-auth-file``), never
printed; a server that refuses them is the user's input to fix (``Unauthorized``, exit 2).
"""

from __future__ import annotations

import base64
import json
import math
import statistics
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from routerlab.ab import counters
from routerlab.ab.driver import BadInput, DriverError, sleep_until
from routerlab.realvllm.promtext import QUERIES, http_get

STALE_INTERVALS = 3  # a sample older than this many scrape intervals at an edge is stale
SETTLE_INTERVALS = 1.5  # an edge is read this many scrape intervals after it: its scrapes have landed
INTERVAL_LOOKBACK_S = 600  # how far back the samples that tell the scrape interval are read
NAMES = {counters.QUERIES: "queries", counters.HITS: "hits", counters.SUCCESS: "success", counters.RUNNING: "running"}


class BadQuery(BadInput):
    """Prometheus refused the query (a matcher that does not parse): the user's input, exit 2."""


class TooShort(BadInput):
    """A window shorter than two scrape intervals: the user's input, exit 2."""


class Unauthorized(BadInput):
    """The server refused the credentials sent (or wanted some): the user's input, exit 2."""


class Server(NamedTuple):
    """A Prometheus server's base URL (no credentials in it) and the Authorization header to send."""

    url: str
    authorization: str | None = None


def server(url: str, auth_file: str | None = None) -> Server:
    """``url`` (``user:password@`` in it becomes basic auth) with the credentials of ``auth_file``:
    one line, either a whole header value (``Bearer TOKEN``, ``Basic B64``), ``user:password``
    (basic auth) or a bare token (bearer). BadInput when the file cannot be read or is empty."""
    parts = urllib.parse.urlsplit(url)
    authorization = None
    if parts.username is not None:
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode()
        parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
    if auth_file:
        try:
            line = Path(auth_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"--prometheus-auth-file {auth_file}: cannot read it ({e})") from None
        if not line or "\n" in line:
            raise BadInput(f"--prometheus-auth-file {auth_file}: give one line (Bearer TOKEN, Basic B64, "
                           "user:password or a bare token)")
        scheme = line.split(" ", 1)[0].lower()
        if " " in line and scheme in ("bearer", "basic"):
            authorization = line
        elif ":" in line:
            authorization = "Basic " + base64.b64encode(line.encode()).decode()
        else:
            authorization = f"Bearer {line}"
    return Server(urllib.parse.urlunsplit(parts).rstrip("/"), authorization)


def _as_server(base: str | Server) -> Server:
    return base if isinstance(base, Server) else Server(base.rstrip("/"))


def query(base: str | Server, expr: str, at: float | None = None, timeout: float = 5.0) -> tuple[str, Any]:
    """(resultType, result) of an instant query at ``at`` (the server's now when None).
    OSError: the server cannot be asked; BadQuery: it refused the expression; Unauthorized: the
    credentials; ValueError: another error."""
    srv = _as_server(base)
    base_url = srv.url
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    headers = {"Authorization": srv.authorization} if srv.authorization else None
    status, body = http_get(base_url + "/api/v1/query?" + urllib.parse.urlencode(params), timeout=timeout,
                            headers=headers)
    if status in (401, 403):
        raise Unauthorized(f"Prometheus {base_url} refused the query (HTTP {status}): "
                           + ("its credentials (--prometheus-auth-file, or user:password@ in the URL) were not "
                              "accepted" if srv.authorization else "it wants credentials: give "
                              "--prometheus-auth-file (or user:password@ in the URL)"))
    try:
        doc = json.loads(body)
    except ValueError:
        raise ValueError(f"{base_url}: HTTP {status}, not Prometheus's API (not JSON)") from None
    if status == 400 and doc.get("errorType") == "bad_data":
        raise BadQuery(f"Prometheus cannot parse {expr}: {doc.get('error')}")
    if status != 200 or doc.get("status") != "success":
        raise ValueError(f"{base_url}: {expr}: {doc.get('error', f'HTTP {status}')}")
    return doc["data"]["resultType"], doc["data"]["result"]


def selector(matchers: str, name: str | None = None) -> str:
    """``name{matchers}``; without a name, every counter the snapshot holds (one query for them all)."""
    if name is None:
        names = "|".join(NAMES)
        return "{" + ", ".join(m for m in (f'__name__=~"{names}"', matchers) if m) + "}"
    return f"{name}{{{matchers}}}"


def increase(base: str | Server, matchers: str, start: float, end: float, timeout: float = 5.0) -> counters.Delta:
    """``sum(increase(counter{matchers}[w]))`` at ``end``, for ``analyze --prometheus`` over a whole run
    (extrapolated by Prometheus; the recorder reads edges instead). OSError / ValueError as ``query``."""
    window = max(1, round(end - start))
    d = counters.Delta()
    for key, name in counters.COUNTERS.items():
        _, result = query(base, f"sum(increase({selector(matchers, name)}[{window}s]))", end, timeout)
        if result:
            setattr(d, key, float(result[0]["value"][1]))
    try:
        _, result = query(base, f"count(count by (instance) ({selector(matchers, QUERIES)}))", end, timeout)
        d.replicas = int(float(result[0]["value"][1])) if result else 0
    except (OSError, ValueError):
        d.replicas = 0
    return d


def scrape_interval(base: str | Server, matchers: str, at: float, timeout: float = 5.0) -> float | None:
    """The longest of the series' median gaps between samples in the last ``INTERVAL_LOOKBACK_S``;
    None when no series has two samples yet."""
    _, result = query(base, f"{selector(matchers, QUERIES)}[{INTERVAL_LOOKBACK_S}s]", at, timeout)
    gaps = []
    for series in result:
        ts = [float(t) for t, _ in series["values"]]
        if len(ts) >= 2:
            gaps.append(statistics.median(b - a for a, b in zip(ts, ts[1:])))
    return max(gaps) if gaps else None


class PrometheusSource:
    """Each pool's replicas as Prometheus sees them (``matchers``: group -> label matchers, no braces)."""

    past = True  # an edge is an instant query at its time: it can be read after the fact

    def __init__(self, base: str | Server, matchers: dict[str, str], clock: Callable[[], float] = time.time,
                 timeout: float = 5.0) -> None:
        self.server = _as_server(base)
        self.matchers, self.clock, self.timeout = matchers, clock, timeout
        self.interval = 0.0
        self.patience = 30.0

    @property
    def base(self) -> str:
        """The server's URL, without credentials (for messages and the windows file)."""
        return self.server.url

    def describe(self) -> dict[str, Any]:
        return {"prometheus": self.base, "selectors": self.matchers, "scrape_interval": self.interval}

    def open(self, window: float, name: str = "--window") -> None:
        """Before the first edge: the server answers, the clocks agree, each matcher selects series
        with a known scrape interval, and the (measured part of the) window holds two scrapes. DriverError (TooShort,
        BadQuery: the input's fault) otherwise."""
        try:
            asked = self.clock()
            _, now = query(self.server, "time()", None, self.timeout)
            skew = float(now[1]) - (asked + self.clock()) / 2
            intervals = {g: scrape_interval(self.server, m, asked, self.timeout) for g, m in self.matchers.items()}
        except OSError as e:
            raise DriverError(f"Prometheus {self.base} unreachable: {e}") from None
        except BadInput:  # a matcher that does not parse, credentials refused
            raise
        except ValueError as e:
            raise DriverError(str(e)) from None
        for group, interval in intervals.items():
            if interval is None:
                raise DriverError(f"{self._name(group)}: {selector(self.matchers[group], QUERIES)} selects no series "
                                  f"with two samples in the last {INTERVAL_LOOKBACK_S} s on {self.base} (a matcher "
                                  "that matches nothing, or replicas scraped for the first time: wait two scrapes)")
        self.interval = max(v for v in intervals.values() if v is not None)
        if abs(skew) > self.interval:
            raise DriverError(f"this machine's clock and Prometheus's differ by {skew:+.1f} s, more than a scrape "
                              f"interval ({self.interval:.3g} s): the edges would read the wrong scrapes; sync the "
                              "clocks (NTP)")
        if window < 2 * self.interval:
            raise TooShort(f"{name} {window:g} s is shorter than two scrape intervals (Prometheus scrapes these "
                           f"series every {self.interval:.3g} s): each edge reads the last scrape before it, so a "
                           f"window needs two scrapes of its own; make it {math.ceil(2 * self.interval)} s or longer")
        self.patience = min(30.0, window)

    def _name(self, group: str) -> str:
        return "the fleet" if group == "fleet" else f"the {group} pool"

    def _edge(self, matchers: str, at: float) -> counters.Snapshot:
        """One group's replicas at ``at``: instance -> counters, or -> why it is unreadable there."""
        _, values = query(self.server, f"sum by (__name__, job, instance) ({selector(matchers)})", at, self.timeout)
        _, stamps = query(self.server, f"max by (job, instance) (timestamp({selector(matchers, QUERIES)}))", at,
                          self.timeout)
        jobs: dict[str, list[str]] = {}
        out: counters.Snapshot = {}
        for s in stamps:
            instance = s["metric"].get("instance", "")
            jobs.setdefault(instance, []).append(s["metric"].get("job", ""))
            age = at - float(s["value"][1])
            out[instance] = (f"last sample {age:.1f} s before the edge (more than {STALE_INTERVALS} scrape intervals: "
                             "stale)") if age > STALE_INTERVALS * self.interval else {k: 0.0 for k in NAMES.values()}
        for instance, names in jobs.items():
            if len(names) > 1:
                out[instance] = (f"scraped by {len(names)} jobs ({', '.join(sorted(names))}): add job=\"...\" to the "
                                 "matcher, or it would be counted twice")
        for s in values:
            entry = out.get(s["metric"].get("instance", ""))
            if isinstance(entry, dict) and s["metric"].get("__name__") in NAMES:
                entry[NAMES[s["metric"]["__name__"]]] = float(s["value"][1])
        return out

    def read(self, at: float) -> dict[str, counters.Snapshot]:
        """Every group's replicas at ``at``, asked once the scrapes before ``at`` have landed; a server
        that does not answer is asked again for ``patience`` s (the instant stays readable), then
        DriverError."""
        sleep_until(at + SETTLE_INTERVALS * self.interval, self.clock)
        deadline = self.clock() + self.patience
        while True:
            try:
                return {g: self._edge(m, at) for g, m in self.matchers.items()}
            except BadInput:
                raise
            except (OSError, ValueError) as e:
                if self.clock() >= deadline:
                    raise DriverError(f"Prometheus {self.base} could not be read for {self.patience:.0f} s: "
                                      f"{e}") from None
                time.sleep(0.5)
