"""Proxy load benchmark: concurrent harnesses calling through the recording proxy into PostgreSQL.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/proxy_load.py                 # 64 harnesses, >= 10,000 calls
    .venv/bin/python bench/proxy_load.py --harnesses 16 --calls 20                # a quick look

The proxy is wired as runs/orchestrator.py wires it: `create_app(cached_directory(run_id, ttl_s=0.5), DjangoRecorder(),
...)` served by ProxyServer on its own thread, recording ModelCall rows through runs.recorder into a fresh
PostgreSQL database (`<DATABASE_URL's name>_proxyload_<pid>`, dropped at the end unless --keep). Only the LLM
upstream is a fake: tests/proxy/fake_upstream.FakeVLLM in its own process, answering like vLLM with prompt token
ids, token ids and logprobs after --latency seconds (streams: --chunk-delay between chunks).

Each harness is one rollout (its own row, key and base URL) and runs in a subprocess (bench/_proxy_load_harness.py:
--per-process harnesses per subprocess, asyncio clients). It holds a multi-turn conversation (a fresh one every
EPISODE_TURNS turns) and cycles through Chat Completions (whole and streamed), Completions, Responses and Anthropic
Messages. Every Chat Completions and Completions call is sent twice, side by side: through the proxy and straight to
the upstream with the same body (which goes first alternates), so the added latency is measured under the same load
in the same run.

Figures: added p50/p99 = proxy p50/p99 minus direct p50/p99 over those paired calls; the recorder's lag = time
from a call's answer (the proxy's RecordedCall.started_at + latency_ms, when the engine's answer was in) to the
moment DjangoRecorder.record returned for it (its ModelCall row committed); the backlog = calls answered but not
yet committed (the recorder's pending list plus the proxy's retry queue), sampled every 50 ms and at the end.

Last line: RESULT load_calls_sent=<n> load_calls_recorded=<n> load_recorded_equals_sent=<true|false>
added_p50_ms=<x> added_p99_ms=<y> recorder_lag_p50_ms=<a> recorder_lag_p99_ms=<b> recorder_lag_max_ms=<c>
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench._proxy_load_harness import PAIRED  # noqa: E402

HARNESS_SCRIPT = ROOT / "bench" / "_proxy_load_harness.py"
"""The subprocesses' entry: one per --per-process harnesses, and one for the fake engine."""


def timed_recorder():
    """The real DjangoRecorder, noting when each record call returns (its row committed) against its answer."""
    from runs.recorder import DjangoRecorder

    class TimedRecorder(DjangoRecorder):
        def __init__(self) -> None:
            super().__init__()
            self.lags_ms: list[float] = []
            self.committed: list[tuple[float, float]] = []  # (wall time committed, lag ms), in commit order

        async def record(self, call) -> None:
            await super().record(call)
            now = time.time()
            lag = (now - (call.started_at + call.latency_ms / 1000.0)) * 1000.0
            self.lags_ms.append(lag)
            self.committed.append((now, lag))

        @property
        def pending(self) -> int:
            return len(self._pending)

    return TimedRecorder()


def create_load_rollouts(harnesses: int):
    """A running run of a `proxy-load` user with `harnesses` running rollouts: (run, [(rollout id, key)])."""
    from django.contrib.auth import get_user_model

    from runs import rollout_services
    from runs.models import Run, RunStatus

    owner, _ = get_user_model().objects.get_or_create(username="proxy-load")
    # The row only: services.create_run would also enqueue the run for a Celery worker to train.
    run = Run.objects.create(owner=owner, name=f"proxy load {harnesses}", model="load-model", status=RunStatus.RUNNING)
    keys = []
    for i in range(harnesses):
        rollout, secret = rollout_services.create_rollout(run, task=None, split="train", step=0, group=i, attempt=0)
        rollout_services.start_rollout(rollout.pk)
        keys.append((rollout.pk, secret))
    return run, keys


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class LoadReport:
    """What one load run sent, what the database holds, and the timings."""

    harnesses: int
    calls_per_harness: int
    wall_s: float
    results: list[dict]  # one per HTTP call the harnesses made (proxy and direct)
    recorded: int  # ModelCall rows of the run
    recorded_per_rollout: dict[int, list[int]]  # rollout id -> its rows' seqs in order
    recorded_apis: Counter
    rows_with_tokens: int  # rows with prompt ids, completion ids and one logprob per completion id
    recorded_statuses: Counter
    recorded_errors: Counter  # ModelCall.error texts of the rows that have one
    lags_ms: list[float]
    lag_trend_ms: tuple[float, float]  # p99 lag of the first and of the last tenth of the commits
    backlog_max: int
    backlog_end: int  # answered calls not yet committed when the last harness had finished
    rows_at_end: int  # rows committed when the last harness had finished
    rollout_ids: list[int] = field(default_factory=list)

    def calls(self, path: str) -> list[dict]:
        return [r for r in self.results if r["path"] == path]

    @property
    def sent(self) -> int:
        return len(self.calls("proxy"))

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["ok"]]

    @property
    def server_errors(self) -> int:
        return sum(1 for r in self.results if r["status"] >= 500) + sum(
            n for status, n in self.recorded_statuses.items() if status >= 500)

    def paired_ms(self, path: str, kind: str | None = None) -> list[float]:
        return [r["ms"] for r in self.calls(path) if r["kind"] in PAIRED and kind in (None, r["kind"])]

    def added_ms(self, q: float, kind: str | None = None) -> float:
        return percentile(self.paired_ms("proxy", kind), q) - percentile(self.paired_ms("direct", kind), q)

    def lines(self) -> list[str]:
        """The human-readable summary."""
        out = [f"{self.harnesses} harnesses x {self.calls_per_harness} calls in {self.wall_s:.1f} s: "
               f"{self.sent} sent through the proxy ({self.sent / self.wall_s:.0f} calls/s), "
               f"{len(self.calls('direct'))} straight to the upstream; {len(self.failed)} failed, "
               f"{self.server_errors} with a 5xx"]
        for kind in sorted(PAIRED):
            p, d = self.paired_ms("proxy", kind), self.paired_ms("direct", kind)
            out.append(f"  {kind:12s} proxy p50 {percentile(p, .5):7.1f} p99 {percentile(p, .99):7.1f} ms | direct "
                       f"p50 {percentile(d, .5):7.1f} p99 {percentile(d, .99):7.1f} ms | added p50 "
                       f"{self.added_ms(.5, kind):6.1f} p99 {self.added_ms(.99, kind):6.1f} ms ({len(p)} pairs)")
        for kind in ("responses", "messages"):
            p = [r["ms"] for r in self.calls("proxy") if r["kind"] == kind]
            out.append(f"  {kind:12s} proxy p50 {percentile(p, .5):7.1f} p99 {percentile(p, .99):7.1f} ms "
                       f"({len(p)} calls; no direct twin: the upstream speaks Chat Completions)")
        for (path, kind, status, error), n in Counter((r["path"], r["kind"], r["status"], r["error"])
                                                      for r in self.failed).most_common():
            out.append(f"  FAILED x{n}: {path} {kind} status {status}: {error or '(unexpected body)'}")
        for error, n in self.recorded_errors.most_common():
            out.append(f"  recorded error x{n}: {error}")
        out.append(f"recorded {self.recorded} rows ({dict(self.recorded_apis)}), {self.rows_with_tokens} with token "
                   f"ids and logprobs; statuses {dict(self.recorded_statuses)}")
        out.append(f"recorder lag p50 {percentile(self.lags_ms, .5):.1f} p99 {percentile(self.lags_ms, .99):.1f} "
                   f"max {max(self.lags_ms, default=math.nan):.1f} ms over {len(self.lags_ms)} records; p99 in the "
                   f"first tenth {self.lag_trend_ms[0]:.1f} ms, last tenth {self.lag_trend_ms[1]:.1f} ms; backlog max "
                   f"{self.backlog_max}, at the end {self.backlog_end} (rows committed then: {self.rows_at_end})")
        return out

    def result_line(self) -> str:
        equal = self.recorded == self.sent
        return (f"RESULT load_calls_sent={self.sent} load_calls_recorded={self.recorded} "
                f"load_recorded_equals_sent={str(equal).lower()} added_p50_ms={self.added_ms(.5):.1f} "
                f"added_p99_ms={self.added_ms(.99):.1f} recorder_lag_p50_ms={percentile(self.lags_ms, .5):.1f} "
                f"recorder_lag_p99_ms={percentile(self.lags_ms, .99):.1f} "
                f"recorder_lag_max_ms={max(self.lags_ms, default=math.nan):.1f}")


def _wait_ready(url: str, process: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s at {url}")


def _start(argv: list[str], log: Path, stdin=None) -> subprocess.Popen:
    with open(log, "wb") as out:  # the child holds its own copy of the file
        return subprocess.Popen([sys.executable, str(HARNESS_SCRIPT), *argv], stdin=stdin,
                                stdout=subprocess.PIPE if stdin else out,
                                stderr=out if stdin else subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT, text=bool(stdin))


def run_load(harnesses: int, calls: int, workdir: Path, latency_s: float = 0.2, chunk_delay_s: float = 0.004,
             per_process: int = 1, timeout_s: float = 1800.0) -> LoadReport:
    """Run the load (Django set up, on a migrated database) and report; every process it starts is stopped."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    from common.procs import free_port, kill_groups
    from proxy.app import create_app
    from proxy.server import ProxyServer
    from proxy.types import UpstreamConfig
    from runs.models import ModelCall
    from runs.recorder import cached_directory

    if harnesses < 1 or calls < 1 or per_process < 1:
        raise ValueError(f"harnesses, calls and per_process must be >= 1, got {harnesses}, {calls}, {per_process}")
    workdir.mkdir(parents=True, exist_ok=True)
    run, keys = create_load_rollouts(harnesses)
    port = free_port()
    upstream_url = f"http://127.0.0.1:{port}/v1"
    processes: list[subprocess.Popen] = []
    server = None
    stop_sampling = threading.Event()
    try:
        upstream = _start(["--serve-upstream", "--port", str(port), "--latency", str(latency_s),
                           "--chunk-delay", str(chunk_delay_s)], workdir / "upstream.log")
        processes.append(upstream)
        _wait_ready(upstream_url + "/models", upstream, "fake engine")
        recorder = timed_recorder()
        app = create_app(cached_directory(run.pk, ttl_s=0.5), recorder,
                         UpstreamConfig(base_url=upstream_url, served_model="load-model"))
        server = ProxyServer(app, host="127.0.0.1", port=0).start()

        specs = []
        for start in range(0, harnesses, per_process):
            k = len(specs)
            spec = {"calls": calls, "direct": upstream_url, "served_model": "load-model", "timeout_s": 300,
                    "out": str(workdir / f"harness-{k}.json"),
                    "harnesses": [{"index": i, "key": keys[i][1], "url": server.base_url(str(keys[i][0]))}
                                  for i in range(start, min(start + per_process, harnesses))]}
            (workdir / f"harness-{k}.spec.json").write_text(json.dumps(spec))
            specs.append(spec)
        clients = [_start(["--harness", str(workdir / f"harness-{k}.spec.json")], workdir / f"harness-{k}.log",
                          stdin=subprocess.PIPE) for k in range(len(specs))]
        processes += clients
        for k, client in enumerate(clients):
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError(f"harness process {k} did not start; see {workdir / f'harness-{k}.log'}")

        backlog = {"max": 0}

        def sample() -> None:  # plain reads of a list's length and a deque's: safe from another thread
            while not stop_sampling.wait(0.05):
                backlog["max"] = max(backlog["max"], recorder.pending + len(app.records.retry))

        sampler = threading.Thread(target=sample, name="backlog-sampler", daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        for client in clients:
            client.stdin.write("go\n")
            client.stdin.flush()
        deadline = time.monotonic() + timeout_s
        for k, client in enumerate(clients):
            try:
                code = client.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"harness process {k} still running after {timeout_s:.0f}s") from None
            if code != 0:
                raise RuntimeError(f"harness process {k} exited with code {code}; see {workdir / f'harness-{k}.log'}")
        wall = time.perf_counter() - t0
        backlog_end = recorder.pending + len(app.records.retry)
        rows_at_end = ModelCall.objects.filter(rollout__run=run).count()
        stop_sampling.set()
        sampler.join()
        server.stop()  # flushes whatever is still pending
        server = None

        results = [r for spec in specs for r in json.loads(Path(spec["out"]).read_text())]
        per_rollout: dict[int, list[int]] = {pk: [] for pk, _ in keys}
        apis, statuses, with_tokens = Counter(), Counter(), 0
        errors = Counter(e[:200] for e in ModelCall.objects.filter(rollout__run=run).exclude(error="")
                         .values_list("error", flat=True))
        rows = ModelCall.objects.filter(rollout__run=run).order_by("rollout_id", "seq").values_list(
            "rollout_id", "seq", "api", "status_code", "prompt_ids", "completion_ids", "logprobs")
        for rollout_id, seq, api, status, prompt_ids, completion_ids, logprobs in rows.iterator(chunk_size=500):
            per_rollout[rollout_id].append(seq)
            apis[api] += 1
            statuses[status] += 1
            with_tokens += bool(prompt_ids and completion_ids and len(logprobs) == len(completion_ids))
        tenth = max(1, len(recorder.committed) // 10)
        trend = (percentile([lag for _, lag in recorder.committed[:tenth]], .99),
                 percentile([lag for _, lag in recorder.committed[-tenth:]], .99))
        return LoadReport(harnesses, calls, wall, results, sum(statuses.values()), per_rollout, apis, with_tokens,
                          statuses, errors, list(recorder.lags_ms), trend, backlog["max"], backlog_end, rows_at_end,
                          [pk for pk, _ in keys])
    finally:
        stop_sampling.set()
        if server is not None:
            server.stop()
        kill_groups([process.pid for process in processes], grace_s=5)
        for process in processes:
            process.wait()
        # The proxy's database thread (asgiref's) keeps its connection: let the database go.
        asyncio.run(sync_to_async(connections.close_all)())


# --- the benchmark ------------------------------------------------------------------------------------------


def _admin_sql(url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        conn.execute(statement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--harnesses", type=int, default=64, help="concurrent harnesses (rollouts)")
    parser.add_argument("--calls", type=int, default=160, help="proxied calls per harness (64 x 160 = 10,240)")
    parser.add_argument("--per-process", type=int, default=1, help="harnesses per client subprocess")
    parser.add_argument("--latency", type=float, default=0.2, help="fake engine seconds before it answers")
    parser.add_argument("--chunk-delay", type=float, default=0.004, help="fake engine seconds between stream chunks")
    parser.add_argument("--database-url", default=os.environ.get("DATABASE_URL", ""),
                        help="PostgreSQL server (postgres://user@host:port/name); the bench makes <name>_proxyload_<pid>")
    parser.add_argument("--keep", action="store_true", help="keep the database and the harness logs")
    args = parser.parse_args()
    if not args.database_url.startswith(("postgres://", "postgresql://")):
        parser.error("--database-url (or DATABASE_URL) must name a PostgreSQL server: postgres://user@host:port/name")
    if args.harnesses < 1 or args.calls < 1 or args.per_process < 1:
        parser.error("--harnesses, --calls and --per-process must be >= 1")

    db_name = f"{args.database_url.rsplit('/', 1)[1] or 'lightning'}_proxyload_{os.getpid()}"
    db_url = args.database_url.rsplit("/", 1)[0] + "/" + db_name
    workdir = Path(tempfile.mkdtemp(prefix="proxy-load-"))
    os.environ.update(DATABASE_URL=db_url, LIGHTNING_DATA_DIR=str(workdir / "data"), DEBUG="0",
                      DJANGO_SETTINGS_MODULE="lightning_web.settings", CHANNELS_PREFIX=f"proxy-load-{os.getpid()}")
    # An explicit Redis for the run events (settings would otherwise start an embedded one in the data dir).
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    _admin_sql(args.database_url, f'CREATE DATABASE "{db_name}"')
    try:
        import django
        from django.core.management import call_command

        django.setup()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied call otherwise
        call_command("migrate", verbosity=0)
        print(f"load: {args.harnesses} harnesses in {math.ceil(args.harnesses / args.per_process)} subprocesses, "
              f"{args.calls} calls each, fake engine latency {args.latency}s ({args.chunk_delay}s between stream "
              f"chunks); database {db_name}; logs in {workdir}", flush=True)
        report = run_load(args.harnesses, args.calls, workdir, args.latency, args.chunk_delay, args.per_process)
        for line in report.lines():
            print(line)
        print(report.result_line())
    finally:
        if not args.keep:
            from django.db import connections

            connections.close_all()
            _admin_sql(args.database_url, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
