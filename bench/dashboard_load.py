"""Benchmark: server time of every dashboard page of a run on a big run against a small one.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/dashboard_load.py          # PostgreSQL on 127.0.0.1:5432
    .venv/bin/python bench/dashboard_load.py --sqlite                         # a machine without PostgreSQL

It creates a fresh database (PostgreSQL `lightning_bench_<pid>`, user postgres, trust auth; or a SQLite file in
a temporary data dir), migrates it and drops it at the end (--keep keeps it, --reuse times it again). It seeds:

- owner `big`: the big run (10,000 rollouts: 100 steps of 10 groups x 8 attempts, and the 100 val tasks evaluated
  every 5th step, so a 100-task x 20-evaluation validation grid; 10 calls each, so 100,000 ModelCall rows) and a
  small run of its own to compare it with;
- owner `small`: two small runs (100 rollouts: 90 steps of one attempt, 5 val attempts every 45th step; 1,000
  calls each). They have about as many steps as the big run, so about as many metrics and step events: the two
  sides differ in rollouts and calls, which is what a page must not pay for; and a run holding only the same
  100 x 20 grid and one step of the big run's shape (10 x 8 trained rollouts), the small side of the validation
  grid's and the step page's rows: they must not pay for the big run's other rollouts and calls;
- each side's timed run also holds one rollout of 50 tool-calling chat calls with one merged 8,192-token sample
  (the rollout page and the token view are timed on these; the models registry's `tiny` is a real tiny model,
  whose tokenizer the token view decodes with);
- each owner one harness, one dataset of 1,000 tasks and one reward script (through runs.services).

The seeding (call sizes, metrics, events, samples) is bench/seed_big_run.py's, which tests import too.

Each page is requested by its run's owner through django.test.Client (a warm-up that counts the queries, then
the median of --repeat requests, small and big in turn): the big owner's pages of the big run against the small
owner's pages of a small run. A page whose URL name is not built yet is skipped with a line saying so. Per page:
small ms, big ms, ratio, and the query count of each (the big count must equal the small one). --explain N
prints EXPLAIN ANALYZE of the N slowest queries of each page on the big run. The last row is the run page's
websocket: from connecting as static/js/run_page.js does to the last event of its replay.

Last line: RESULT worst_page_ratio=<big/small of the slowest-growing page> worst_page=<name> pages=<n>.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.seed_big_run import (BIG, INSPECT_CALLS, SMALL, Bodies, Shape, drop_bodies, load_bodies,  # noqa: E402
                                seed_inspected_rollout, seed_inspector_run, seed_owner, seed_run)


PG = "postgresql://postgres@127.0.0.1:5432/"

# ---- the database ------------------------------------------------------------------------------------------

def admin_sql(statement: str) -> None:
    import psycopg

    with psycopg.connect(PG + "postgres", autocommit=True) as conn:
        conn.execute(statement)


def setup_django(args, data_dir: Path, db_name: str) -> None:
    """Settings on a fresh data dir and database (or the kept one named by --reuse), migrated."""
    models_dir = data_dir / "models"
    from trainer.models import build_tiny_model

    build_tiny_model(models_dir / "tiny", seed=0, name="tiny")  # a real tokenizer for the token view
    os.environ.pop("REDIS_URL", None)  # the data dir's own embedded Redis (run.status events are published)
    os.environ.update(LIGHTNING_DATA_DIR=str(data_dir), LIGHTNING_MODELS_DIR=str(models_dir),
                      DJANGO_SETTINGS_MODULE="lightning_web.settings", DEBUG="0",
                      LIGHTNING_EMBEDDED_REDIS_OWNER=str(os.getpid()))  # it ends with this bench, however it ends
    if args.sqlite:
        os.environ.pop("DATABASE_URL", None)
    else:
        if not args.reuse:
            admin_sql(f'CREATE DATABASE "{db_name}"')
        os.environ["DATABASE_URL"] = PG + db_name
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def db_size() -> str:
    from django.conf import settings
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_size_pretty(pg_database_size(current_database()))")
            return cursor.fetchone()[0]
    return f"{Path(settings.DATABASES['default']['NAME']).stat().st_size / 2**20:.0f} MB"


@dataclass
class Side:
    """One side of the comparison: a user, the run whose pages are timed, a second run to compare with."""

    label: str
    user: object
    run: int
    peer: int
    dataset: int
    rollout: int
    step: int
    inspected: int  # a rollout of INSPECT_CALLS calls
    sample: int  # its 8k-token sample
    grid_run: int  # a run with 100 val tasks at 20 evaluations (the big run itself on the big side)
    grid_step: int  # a step of 10 x 8 trained rollouts in it


def seed(bodies: Bodies, big: Shape) -> tuple[Side, Side]:
    from runs.models import Rollout

    sides = []
    for label, shape in (("small", SMALL), ("big", big)):
        user, harness, dataset, reward = seed_owner(label)
        started = time.perf_counter()
        run = seed_run(user, harness, dataset, reward, shape, f"{label} run", bodies)
        peer = seed_run(user, harness, dataset, reward, SMALL, f"{label} peer", bodies)
        middle = (Rollout.objects.filter(run_id=run, split="train", step=max(1, shape.steps // 2)).order_by("pk")
                  .first())
        inspected, sample = seed_inspected_rollout(run, vocab_size())
        grid = run if label == "big" else seed_inspector_run(user, harness, dataset, reward)
        print(f"seeded {label}: run {run} ({shape.rollouts} rollouts, {shape.rollouts * shape.calls} calls) and a "
              f"peer run {peer} in {time.perf_counter() - started:.1f} s", flush=True)
        sides.append(Side(label, user, run, peer, dataset.pk, middle.pk, middle.step, inspected, sample, grid,
                          shape.steps if label == "big" else 1))  # the big run's last steps have samples
    return sides[0], sides[1]


def vocab_size() -> int:
    """The registry's tiny model's vocabulary (setup_django builds it): the inspected sample's ids stay below it."""
    from django.conf import settings

    return json.loads((Path(settings.LIGHTNING_MODELS_DIR) / "tiny" / "config.json").read_text())["vocab_size"]


def seeded_sides() -> tuple[Side, Side]:
    """The sides of a database seeded before (--reuse)."""
    from django.contrib.auth import get_user_model

    from runs.models import Rollout, Run

    sides = []
    for label in ("small", "big"):
        user = get_user_model().objects.get(username=label)
        run = Run.objects.get(owner=user, name=f"{label} run")
        peer = Run.objects.get(owner=user, name=f"{label} peer")
        middle = Rollout.objects.filter(run=run, split="train", step=max(1, run.step // 2)).order_by("pk").first()
        inspected = Rollout.objects.get(run=run, call_count=INSPECT_CALLS)
        grid = run if label == "big" else Run.objects.get(owner=user, name="inspector")
        sides.append(Side(label, user, run.pk, peer.pk, run.dataset_id, middle.pk, middle.step, inspected.pk,
                          inspected.samples.get().pk, grid.pk, run.step if label == "big" else 1))
    return sides[0], sides[1]


# ---- the pages ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Page:
    label: str
    url_name: str | None  # a dashboard page's URL name; None for a REST path
    path: Callable[[Side], str | int | tuple]  # the URL's argument(s), or a REST path
    query: str = ""


PAGES = [
    Page("runs-list", "runs-list", lambda s: ""),
    Page("runs-rows", "runs-rows", lambda s: "", "?page=1"),
    Page("run-detail", "run-detail", lambda s: s.run),
    Page("run-metric-series", "run-metric-series", lambda s: s.run),
    Page("run-rollouts", "run-rollouts-table", lambda s: s.run),
    Page("run-rollouts sorted", "run-rollouts-table", lambda s: s.run, "?sort=-reward&page=3"),
    Page("run-rollouts filtered", "run-rollouts-table", lambda s: s.run,
         "?step={step}&split=train&status=succeeded&reward_min=0.5&sort=-duration"),
    Page("run-rollouts search", "run-rollouts-table", lambda s: s.run, "?q=task-01&sort=-calls"),
    Page("rollout-detail", "rollout-detail", lambda s: s.rollout),
    Page("rollout-detail 50 calls", "rollout-detail", lambda s: s.inspected),
    Page("sample-tokens 8k", "sample-tokens", lambda s: s.sample),
    Page("sample-tokens 8k data", "sample-tokens-data", lambda s: s.sample, "?start=0&count=8192"),
    Page("run-val-grid 100x20", "run-val-grid", lambda s: s.grid_run),
    Page("run-detail 100x20 grid", "run-detail", lambda s: s.grid_run),
    Page("run-step 10x8", "run-step", lambda s: (s.grid_run, s.grid_step)),
    Page("run-step-data 10x8", "run-step-data", lambda s: (s.grid_run, s.grid_step)),
    Page("run-compare", "run-compare", lambda s: "", "?ids={run},{peer}"),
    Page("dataset-detail", "dataset-detail", lambda s: s.dataset),
    Page("api run metrics", None, lambda s: f"/api/v1/runs/{s.run}/metrics/"),
    Page("api run rollouts", None, lambda s: f"/api/v1/runs/{s.run}/rollouts/"),
    Page("api run events", None, lambda s: f"/api/v1/runs/{s.run}/events/"),
]
"""Every page about a run or its data, and the JSON its scripts read (the runs list's rows, the charts'
series, the rollouts table); the REST endpoints a user's own scripts page through."""


def page_url(page: Page, side: Side) -> str | None:
    """The page's URL for this side; None while its URL name is not a dashboard page yet."""
    from django.urls import NoReverseMatch, reverse

    if page.url_name is None:
        path = page.path(side)
    else:
        arg = page.path(side)
        args = list(arg) if isinstance(arg, tuple) else [arg] if arg != "" else []
        try:
            path = reverse(page.url_name, args=args)
        except NoReverseMatch:
            return None
    return path + page.query.format(run=side.run, peer=side.peer, step=side.step)


def count_queries(client, url: str) -> tuple[int, int]:
    """(status, query count) of GET url; also the warm-up of the timed requests."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    return response.status_code, len(queries)


def time_pages(requests: list[tuple[object, str]], repeat: int) -> list[float]:
    """Median ms of each (client, url), requested in turn `repeat` times: the machine's noise hits all alike."""
    times: list[list[float]] = [[] for _ in requests]
    for _ in range(repeat):
        for spent, (client, url) in zip(times, requests):
            started = time.perf_counter()
            client.get(url)
            spent.append((time.perf_counter() - started) * 1000)
    return [statistics.median(spent) for spent in times]


def explain(client, url: str, top: int) -> None:
    """EXPLAIN ANALYZE of the `top` slowest queries of GET url (PostgreSQL), under the page's line."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        client.get(url)
    plans = []
    with connection.cursor() as cursor:
        for query in list(queries):
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + query["sql"])
            plan = [line for line, in cursor.fetchall()]
            spent = float(plan[-1].split(":")[1].split()[0])  # "Execution Time: 1.234 ms"
            plans.append((spent, query["sql"], plan))
    for spent, sql, plan in sorted(plans, reverse=True)[:top]:
        print(f"    {spent:.1f} ms  {sql[:300]}")
        for line in plan[:12]:
            print(f"      {line}")


def measure(small: Side, big: Side, repeat: int, failed: list[str],
            explain_top: int = 0) -> list[tuple[str, float, float, int, int]]:
    """Time every page on both sides; a page that fails is added to `failed` and left out."""
    from django.test import Client

    clients = {}
    for side in (small, big):
        clients[side.label] = Client()
        clients[side.label].force_login(side.user)
    rows = []
    print(f"{'page':<24} {'small ms':>9} {'big ms':>9} {'ratio':>6} {'q small':>8} {'q big':>6}")
    for page in PAGES:
        urls = [page_url(page, side) for side in (small, big)]
        if None in urls:
            print(f"skipped {page.url_name}: not built yet", flush=True)
            continue
        requests = [(clients[side.label], url) for side, url in zip((small, big), urls)]
        try:
            (small_status, small_q), (big_status, big_q) = (count_queries(*request) for request in requests)
            if (small_status, big_status) != (200, 200):
                failed.append(f"{page.label}: status {small_status} small, {big_status} big ({urls})")
                continue
            small_ms, big_ms = time_pages(requests, repeat)
        except Exception as exc:  # noqa: BLE001 - a page being written may fail; the others are still measured
            failed.append(f"{page.label}: {type(exc).__name__}: {exc}")
            continue
        ratio = big_ms / small_ms
        rows.append((page.label, small_ms, big_ms, small_q, big_q))
        print(f"{page.label:<24} {small_ms:9.1f} {big_ms:9.1f} {ratio:6.2f} {small_q:8d} {big_q:6d}", flush=True)
        if explain_top:
            explain(clients[big.label], urls[1], explain_top)
    try:
        (small_ms, small_q, small_mb), (big_ms, big_q, big_mb) = time_replays([small, big], max(3, repeat // 2))
    except Exception as exc:  # noqa: BLE001 - as for a page
        failed.append(f"run-detail websocket: {type(exc).__name__}: {exc}")
        return rows
    rows.append(("run-detail websocket", small_ms, big_ms, small_q, big_q))
    print(f"{'run-detail websocket':<24} {small_ms:9.1f} {big_ms:9.1f} {big_ms / small_ms:6.2f} {small_q:8d} "
          f"{big_q:6d}  (replays {small_mb:.1f} MB small, {big_mb:.1f} MB big)", flush=True)
    return rows


def replay_after(last_seq: int) -> int:
    """The seq after which the run page's socket asks for the run's events, given the run's last seq when the page
    was drawn (static/js/run_page.js: the last LOG_LINES = 500 events, for the event log)."""
    return max(0, last_seq - 500)


def time_replays(sides: list[Side], repeat: int) -> list[tuple[float, int, float]]:
    """(median ms, queries, MB) of opening each side's run page websocket until its whole replay has arrived.

    The consumer is called directly with the user in its scope (the ASGI stack's session lookup left out); its
    channel layer is the data dir's embedded Redis.
    """
    import asyncio

    from asgiref.sync import sync_to_async
    from channels.testing import WebsocketCommunicator

    from runs import selectors
    from dashboard.consumers import RunEventsConsumer
    from runs.models import Run, RunEvent

    batches: list[int] = []
    real = selectors.run_events_after

    def counted(*args, **kwargs):
        batches.append(1)
        return real(*args, **kwargs)

    async def replay(side: Side, after: int, events: int) -> tuple[float, int, int]:
        batches.clear()
        socket = WebsocketCommunicator(RunEventsConsumer.as_asgi(), f"/ws/runs/{side.run}/?after={after}")
        socket.scope.update(user=side.user, url_route={"kwargs": {"run_id": side.run}})
        started = time.perf_counter()
        connected, _ = await socket.connect(timeout=60)
        assert connected, f"the websocket of run {side.run} refused {side.label}"
        size = 0
        for _ in range(events):
            size += len(await socket.receive_from(timeout=60))
        spent = (time.perf_counter() - started) * 1000
        await socket.disconnect()
        return spent, size, 1 + len(batches)  # the query that checks the user may see the run, then the batches

    async def run_all() -> list[tuple[float, int, float]]:
        afters = [replay_after(await sync_to_async(Run.objects.values_list("event_seq", flat=True).get)(pk=side.run))
                  for side in sides]
        counts = [await sync_to_async(RunEvent.objects.filter(run_id=side.run, seq__gt=after).count)()
                  for side, after in zip(sides, afters)]
        results: list[list[tuple[float, int, int]]] = [[] for _ in sides]
        for attempt in range(repeat + 1):  # the first is the warm-up
            for i, side in enumerate(sides):
                result = await replay(side, afters[i], counts[i])
                if attempt:
                    results[i].append(result)
        return [(statistics.median(r[0] for r in runs), runs[-1][2], runs[-1][1] / 2**20) for runs in results]

    with mock.patch.object(selectors, "run_events_after", counted):
        return asyncio.run(run_all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite", action="store_true", help="a SQLite file instead of PostgreSQL")
    parser.add_argument("--repeat", type=int, default=7, help="timed requests per page (after one warm-up)")
    parser.add_argument("--keep", action="store_true", help="keep the database (its name is printed) to explore")
    parser.add_argument("--big-steps", type=int, default=BIG.steps,
                        help=f"steps of the big run ({BIG.rollouts // BIG.steps} rollouts each); fewer for a quick try")
    parser.add_argument("--reuse", metavar="DATABASE", help="time the pages of a database kept by --keep (no seeding)")
    parser.add_argument("--explain", type=int, default=0, metavar="N",
                        help="print EXPLAIN ANALYZE of each page's N slowest queries on the big run (PostgreSQL)")
    args = parser.parse_args()
    if args.reuse and args.sqlite:
        parser.error("--reuse names a PostgreSQL database")
    data_dir = Path(tempfile.mkdtemp(prefix="lw-dashboard-bench-"))
    db_name = args.reuse or f"lightning_bench_{os.getpid()}"
    try:
        setup_django(args, data_dir, db_name)
        from django.db import connection

        print(f"database: {connection.vendor} {connection.settings_dict['NAME']}", flush=True)
        if args.reuse:
            small, big = seeded_sides()
        else:
            started = time.perf_counter()
            bodies = Bodies()
            load_bodies(bodies)
            small, big = seed(bodies, replace(BIG, steps=args.big_steps))
            drop_bodies()
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("VACUUM ANALYZE")  # what autovacuum does soon after a load
            print(f"seeding: {time.perf_counter() - started:.1f} s, database size {db_size()}", flush=True)
        failed: list[str] = []
        rows = measure(small, big, args.repeat, failed, args.explain if connection.vendor == "postgresql" else 0)
        grown = [label for label, _, _, small_q, big_q in rows if big_q > small_q]
        if grown:
            print(f"query count grows with the run on: {', '.join(grown)}")
        for line in failed:
            print(f"FAILED {line}")
        label, small_ms, big_ms, _, _ = max(rows, key=lambda row: row[2] / row[1])
        print(f"RESULT worst_page_ratio={big_ms / small_ms:.2f} worst_page={label.replace(' ', '_')} "
              f"pages={len(rows)}")
        if failed:
            raise SystemExit(1)
    finally:
        cleanup(args, data_dir, db_name)


def cleanup(args, data_dir: Path, db_name: str) -> None:
    """After a bench: its database dropped (unless kept or reused), its embedded Redis stopped, its data dir gone."""
    from django.apps import apps

    if apps.ready:
        from django.db import connections

        connections.close_all()
    if not args.sqlite and not args.keep and not args.reuse:
        try:
            admin_sql(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        except Exception as exc:  # noqa: BLE001 - say what is left behind, do not hide the run's own error
            print(f"could not drop database {db_name}: {exc}", file=sys.stderr)
    elif args.keep:
        print(f"kept database {db_name} (time it again with --reuse {db_name}); data dir {data_dir}")
    from lightning_web import embedded_redis

    embedded_redis.stop(data_dir)
    if not args.keep:
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
