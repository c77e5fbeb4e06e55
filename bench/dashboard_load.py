"""Benchmark: server time of every dashboard page of a run on a big run against a small one.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/dashboard_load.py          # PostgreSQL on 127.0.0.1:5432
    .venv/bin/python bench/dashboard_load.py --sqlite                         # a machine without PostgreSQL

It creates a fresh database (PostgreSQL `lightning_bench_<pid>`, user postgres, trust auth; or a SQLite file in
a temporary data dir), migrates it and drops it at the end (--keep keeps it, --reuse times it again). It seeds:

- owner `big`: the big run (10,000 rollouts: 100 steps of 12 groups x 8 attempts, 40 val attempts every 10th
  step; 10 calls each, so 100,000 ModelCall rows) and a small run of its own to compare it with;
- owner `small`: two small runs (100 rollouts: 90 steps of one attempt, 5 val attempts every 45th step; 1,000
  calls each). They have about as many steps as the big run, so about as many metrics and step events: the two
  sides differ in rollouts and calls, which is what a page must not pay for;
- each owner one harness, one dataset of 1,000 tasks and one reward script (through runs.services).

Calls have realistic sizes: a request of ~8 KB of messages, ~2,000 prompt ids, ~200 completion ids with their
logprobs and a chat.completion response (~19 KB a row once stored). Bodies are serialized once into a pool and
copied in SQL (INSERT ... SELECT): the database stores and compresses every row's values on its own but parses
the JSON only once; the other tables go in with COPY (executemany on SQLite). Every step has ~45 metrics; every
rollout a `call.recorded` and a `rollout.status` event, every step six more; the train rollouts of the last
tenth of the steps have a Sample.

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
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

PG = "postgresql://postgres@127.0.0.1:5432/"
POOL = 64  # distinct bodies of each kind; rows cycle through them (TOAST compresses each value on its own)
WORDS = [f"{a}{b}{c}" for a in ("ka", "lo", "mer", "tis", "ub", "zan", "or", "pe") for b in ("ri", "sta", "vo", "gle",
         "n", "dra", "mu", "xe") for c in ("", "s", "ed", "ing", "ly", "tion", "er", "al")]


# ---- the database ------------------------------------------------------------------------------------------

def admin_sql(statement: str) -> None:
    import psycopg

    with psycopg.connect(PG + "postgres", autocommit=True) as conn:
        conn.execute(statement)


def setup_django(args, data_dir: Path, db_name: str) -> None:
    """Settings on a fresh data dir and database (or the kept one named by --reuse), migrated."""
    models_dir = data_dir / "models"
    (models_dir / "tiny").mkdir(parents=True)
    (models_dir / "tiny" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (models_dir / "tiny" / "lightning_model.json").write_text(json.dumps({"name": "tiny", "origin": "tiny",
                                                                          "params": 1}))
    os.environ.pop("REDIS_URL", None)  # the data dir's own embedded Redis (run.status events are published)
    os.environ.update(LIGHTNING_DATA_DIR=str(data_dir), LIGHTNING_MODELS_DIR=str(models_dir),
                      DJANGO_SETTINGS_MODULE="lightning_web.settings", DEBUG="0")
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


def load_rows(model, columns: list[str], rows: list[tuple]) -> None:
    """Insert rows (tuples in `columns` order; JSON fields as serialized text) with COPY, or executemany."""
    from django.db import connection, transaction

    fields = [model._meta.get_field(name) for name in columns]
    names = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            with cursor.cursor.copy(f"COPY {model._meta.db_table} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            return
        stamps = {i for i, f in enumerate(fields) if f.get_internal_type() == "DateTimeField"}
        rows = [[connection.ops.adapt_datetimefield_value(v) if i in stamps else v for i, v in enumerate(row)]
                for row in rows]
        insert = f"INSERT INTO {model._meta.db_table} ({names}) VALUES ({', '.join(['%s'] * len(fields))})"
        for start in range(0, len(rows), 1000):
            cursor.executemany(insert, rows[start:start + 1000])


def load_bodies(bodies: "Bodies") -> None:
    """The pool of call bodies as a table (bench_bodies), for insert_calls to copy from."""
    from django.db import connection

    json_type = "jsonb" if connection.vendor == "postgresql" else "text"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE bench_bodies (i integer PRIMARY KEY, request {json_type}, "
                       f"response {json_type}, prompt_ids {json_type}, completion_ids {json_type}, "
                       f"logprobs {json_type})")
        cursor.executemany("INSERT INTO bench_bodies VALUES (%s, %s, %s, %s, %s, %s)", list(zip(
            range(POOL), bodies.request, bodies.response, bodies.prompt_ids, bodies.completion_ids, bodies.logprobs)))
        cursor.execute("CREATE TABLE bench_seqs (seq integer PRIMARY KEY)")
        cursor.executemany("INSERT INTO bench_seqs VALUES (%s)", [(seq,) for seq in range(100)])


def insert_calls(run_id: int, per_rollout: int) -> int:
    """`per_rollout` ModelCall rows for every rollout of the run, bodies copied from the pool in SQL.

    Copying stored JSON spares the database parsing it again for every row (what makes a COPY of 100k calls
    slow); each row's values are still stored, and compressed, on their own.
    """
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_modelcall (rollout_id, seq, api, stream, request, response, prompt_ids, completion_ids,"
            " logprobs, finish_reason, status_code, latency_ms, policy_version, drift, sampling_overrides, error,"
            " created_at) "
            "SELECT r.id, s.seq, 'chat', %s, b.request, b.response, b.prompt_ids, b.completion_ids, b.logprobs,"
            " 'stop', 200, 300 + (r.id * 31 + s.seq) %% 900, r.policy_version, 'clean', '{}', '',"
            " r.finished_at "
            "FROM runs_rollout r CROSS JOIN bench_seqs s JOIN bench_bodies b ON b.i = (r.id * 7 + s.seq) %% %s "
            "WHERE r.run_id = %s AND s.seq < %s",
            [False, POOL, run_id, per_rollout])
        return cursor.rowcount


# ---- what is seeded ----------------------------------------------------------------------------------------

def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


class Bodies:
    """POOL serialized bodies of each kind, at the sizes a 2k-token agent turn has."""

    def __init__(self, seed: int = 0):
        rng = random.Random(seed)
        self.request = [json.dumps(self._request(rng, i)) for i in range(POOL)]
        self.response = [json.dumps(self._response(rng, i)) for i in range(POOL)]
        self.prompt_ids = [json.dumps([rng.randrange(49152) for _ in range(rng.randint(1900, 2100))])
                           for _ in range(POOL)]
        completions = [[rng.randrange(49152) for _ in range(rng.randint(150, 250))] for _ in range(POOL)]
        self.completion_ids = [json.dumps(ids) for ids in completions]
        self.logprobs = [json.dumps([-rng.expovariate(4.0) for _ in ids]) for ids in completions]
        self.sample_tokens = [json.dumps([rng.randrange(49152) for _ in range(2300)]) for _ in range(8)]
        self.sample_mask = [json.dumps([0] * 2000 + [1] * 300) for _ in range(8)]
        self.sample_logprobs = [json.dumps([0.0] * 2000 + [-rng.expovariate(4.0) for _ in range(300)])
                                for _ in range(8)]
        self.stdout = [text(rng, 2000) for _ in range(POOL)]

    @staticmethod
    def _request(rng: random.Random, i: int) -> dict:
        messages = [{"role": "system", "content": text(rng, 1500)}, {"role": "user", "content": text(rng, 600)}]
        while sum(len(m["content"]) for m in messages) < 8000:
            messages.append({"role": "assistant", "content": text(rng, 700)})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}_{len(messages)}", "content": text(rng, 900)})
        return {"model": "policy", "messages": messages, "temperature": 1.0, "max_tokens": 1024,
                "tools": [{"type": "function", "function": {"name": "python", "description": text(rng, 200),
                                                            "parameters": {"type": "object"}}}]}

    @staticmethod
    def _response(rng: random.Random, i: int) -> dict:
        return {"id": f"chatcmpl-{i}", "object": "chat.completion", "created": 1_780_000_000 + i, "model": "policy",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text(rng, 800)}}],
                "usage": {"prompt_tokens": 2000, "completion_tokens": 200, "total_tokens": 2200}}


METRICS = ["actor/clip_frac", "actor/entropy", "actor/grad_norm", "actor/ratio_mean", "advantage/abs_mean",
           "advantage/mean", "advantage/zero_frac", "is/truncated_frac", "is/weight_max", "is/weight_mean",
           "is/weight_min", "length/completion_tokens_mean", "length/sample_tokens_mean", "loss/kl", "loss/policy",
           "loss/total", "mismatch/kl", "mismatch/logprob_abs", "reward/mean", "reward/pass_rate", "reward/std",
           "rollout/calls_mean", "rollout/failed_frac", "rollout/generated_tokens_per_s", "rollout/infra_failures",
           "rollout/policy_failures", "staleness/max", "staleness/mean", "time/busy_frac", "time/drain",
           "time/generate", "time/idle", "time/score", "time/step", "time/sync", "time/train",
           "train/logprob_mismatch_max", "train/logprob_mismatch_mean", "train/loss_tokens", "train/samples",
           "train/tokens", "train/tokens_per_s", "drift/realign_rate", "drift/fork_rate"]
EVAL_METRICS = ["eval/pass@1", "eval/pass@1_greedy", "eval/pass@k", "eval/reward_mean", "eval/seconds", "eval/tasks"]


@dataclass(frozen=True)
class Shape:
    steps: int
    groups: int
    group_size: int
    eval_every: int
    eval_rollouts: int
    calls: int = 10

    def config(self) -> dict:
        """The run's config: 10 steps to go; one attempt a task needs an advantage without a group baseline."""
        return {"steps": self.steps + 10, "tasks_per_step": self.groups, "group_size": self.group_size,
                **({"advantage": "dr_grpo"} if self.group_size < 2 else {})}

    @property
    def rollouts(self) -> int:
        return self.steps * self.groups * self.group_size + self.steps // self.eval_every * self.eval_rollouts


BIG = Shape(steps=100, groups=12, group_size=8, eval_every=10, eval_rollouts=40)
SMALL = Shape(steps=90, groups=1, group_size=1, eval_every=45, eval_rollouts=5)
"""About as many steps as BIG, so about as many metrics and step events: the two differ in rollouts and calls."""


def seed_owner(name: str):
    """A user with a harness, a dataset of 1,000 tasks and a reward script, through the services."""
    from django.contrib.auth import get_user_model

    from runs import services

    user = get_user_model().objects.create_user(name, password=f"{name}-password-123")
    rng = random.Random(1)
    tasks = [{"id": f"task-{i:04d}", "question": text(rng, 300), "answer": str(rng.randrange(1000)),
              "split": "val" if i % 10 == 0 else "train"} for i in range(1000)]
    dataset = services.create_dataset(user, name="tasks", content="\n".join(map(json.dumps, tasks)).encode(),
                                      filename="tasks.jsonl", split_field="split")
    harness = services.create_harness(user, name="agent", command=["python", "agent.py", "{task_file}",
                                                                   "{output_file}"])
    reward = services.create_reward_script(user, name="exact", source="def reward(task, outcome):\n"
                                           "    return float(outcome.get('answer') == task.get('answer'))\n")
    return user, harness, dataset, reward


def seed_run(owner, harness, dataset, reward, shape: Shape, name: str, bodies: Bodies) -> int:
    """A run of `shape` with its rollouts, calls, metrics, events and samples; its id."""
    from runs import services
    from runs.models import Metric, Rollout, RunEvent, Run, Sample, Task

    with mock.patch.object(services, "enqueue_run", lambda run_id: None):  # no worker: the run is seeded
        run = services.create_run(owner, name=name, model="tiny", reward_script=reward, harness=harness,
                                  dataset=dataset, config=shape.config())
    rng = random.Random(run.pk)
    started = datetime.now(timezone.utc) - timedelta(minutes=6 * shape.steps + 30)
    at = lambda step, seconds=0.0: started + timedelta(minutes=6 * (step - 1), seconds=seconds)  # noqa: E731
    train = list(Task.objects.filter(dataset=dataset, split="train").values_list("pk", flat=True))
    val = list(Task.objects.filter(dataset=dataset, split="val").values_list("pk", flat=True))
    rollouts = []
    for step in range(1, shape.steps + 1):
        for group in range(shape.groups):
            task = rng.choice(train)
            for attempt in range(shape.group_size):
                rollouts.append(_rollout(run, rng, bodies, task, "train", step, group, attempt, at(step, 5)))
        if step % shape.eval_every == 0:
            for index in range(shape.eval_rollouts):
                rollouts.append(_rollout(run, rng, bodies, val[index % len(val)], "val", step, index, 0,
                                         at(step, 200), greedy=index % 4 == 0))
    Rollout.objects.bulk_create(rollouts, batch_size=1000)
    started_calls = time.perf_counter()
    calls = insert_calls(run.pk, shape.calls)
    print(f"  {name}: {calls} calls in {time.perf_counter() - started_calls:.1f} s", flush=True)
    trained = [r for r in rollouts if r.split == "train" and r.step > shape.steps - max(1, shape.steps // 10)]
    samples = [(r.pk, 0, bodies.sample_tokens[r.pk % 8], bodies.sample_mask[r.pk % 8],
                bodies.sample_logprobs[r.pk % 8], rng.uniform(-1, 1), json.dumps(list(range(shape.calls))),
                "merged", r.policy_version, r.finished_at) for r in trained]
    load_rows(Sample, ["rollout", "index", "token_ids", "loss_mask", "logprobs", "advantage", "call_seqs", "build",
                       "policy_version", "created_at"], samples)
    metrics = [(run.pk, step, metric, rng.random(), at(step, 330)) for step in range(1, shape.steps + 1)
               for metric in METRICS + (EVAL_METRICS if step % shape.eval_every == 0 else [])]
    load_rows(Metric, ["run", "step", "name", "value", "created_at"], metrics)
    events = _events(run.pk, rollouts, metrics, shape, at)
    load_rows(RunEvent, ["run", "seq", "kind", "payload", "created_at"], events)
    Run.objects.filter(pk=run.pk).update(status="running", step=shape.steps, policy_version=shape.steps,
                                         started_at=started, heartbeat_at=at(shape.steps, 330),
                                         event_seq=events[-1][1], phase=f"generating step {shape.steps + 1}")
    return run.pk


def _rollout(run, rng: random.Random, bodies: Bodies, task: int, split: str, step: int, group: int, attempt: int,
             begin: datetime, greedy: bool = False):
    from runs.models import Rollout

    failed = rng.random() < 0.05
    reward = None if failed else float(rng.random() < 0.4 + step / 400)
    return Rollout(run=run, task_id=task, split=split, step=step, group=group, attempt=attempt, greedy=greedy,
                   policy_version=step - 1, status="failed" if failed else "succeeded", reward=reward,
                   reward_detail={"reward": reward, "checked": True, "answer": str(rng.randrange(1000))},
                   exit_code=1 if failed else 0, stdout_tail=bodies.stdout[rng.randrange(POOL)],
                   stderr_tail="Traceback: harness crashed" if failed else "",
                   error="harness exited with code 1" if failed else "",
                   failure_kind="policy" if failed else "", secret_hash=f"{rng.getrandbits(256):064x}",
                   call_count=10, started_at=begin, finished_at=begin + timedelta(seconds=rng.uniform(20, 120)))


def _events(run_id: int, rollouts, metrics, shape: Shape, at: Callable) -> list[tuple]:
    """The run's events in seq order (seq 1, run.status queued, was written by create_run)."""
    by_step: dict[int, list] = {}
    for r in rollouts:
        by_step.setdefault(r.step, []).append(r)
    values: dict[int, dict[str, float]] = {}
    for _, step, name, value, _ in metrics:
        values.setdefault(step, {})[name] = value
    rows: list[tuple] = []

    def add(kind: str, payload: dict, when: datetime) -> None:
        rows.append((run_id, len(rows) + 2, kind, json.dumps(payload), when))

    add("run.status", {"status": "running", "error": ""}, at(1))
    for step in range(1, shape.steps + 1):
        add("run.phase", {"phase": f"generating step {step}", "progress": None}, at(step))
        for r in by_step[step]:
            add("call.recorded", {"rollout": r.pk, "calls": [
                {"seq": s, "api": "chat", "status": 200, "latency_ms": 512.0, "completion_tokens": 200}
                for s in range(shape.calls)]}, r.finished_at)
            add("rollout.status", {"rollout": r.pk, "status": r.status, "reward": r.reward, "split": r.split,
                                   "step": r.step, "group": r.group, "attempt": r.attempt, "error": r.error,
                                   "failure_kind": r.failure_kind}, r.finished_at)
        for phase in ("training", "syncing weights", "evaluating"):
            add("run.phase", {"phase": f"{phase} step {step}", "progress": None}, at(step, 300))
        add("run.metrics", {"step": step, "values": values[step]}, at(step, 330))
        add("run.log", {"line": f"checkpoint of step {step} saved"}, at(step, 331))
    return rows


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
        print(f"seeded {label}: run {run} ({shape.rollouts} rollouts, {shape.rollouts * shape.calls} calls) and a "
              f"peer run {peer} in {time.perf_counter() - started:.1f} s", flush=True)
        sides.append(Side(label, user, run, peer, dataset.pk, middle.pk, middle.step))
    return sides[0], sides[1]


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
        sides.append(Side(label, user, run.pk, peer.pk, run.dataset_id, middle.pk, middle.step))
    return sides[0], sides[1]


# ---- the pages ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Page:
    label: str
    url_name: str | None  # a dashboard page's URL name; None for a REST path
    path: Callable[[Side], str]
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
        try:
            path = reverse(page.url_name, args=[arg] if arg != "" else [])
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
    from runs.consumers import RunEventsConsumer
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
            with connection.cursor() as cursor:
                cursor.execute("DROP TABLE bench_bodies")
                cursor.execute("DROP TABLE bench_seqs")
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
        _cleanup(args, data_dir, db_name)


def _cleanup(args, data_dir: Path, db_name: str) -> None:
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
