"""Seeding of the dashboard benchmark's runs into the current database: the big run (100,000 calls) and small ones.

bench/dashboard_load.py times the dashboard's pages on them; tests/dashboard/test_export_memory.py exports the big run.
Django must be set up (and migrated) before these are called.

    from bench.seed_big_run import seed_big_run
    user, run_id = seed_big_run()        # owner `big`: 10,000 rollouts of 10 calls, metrics, events, samples

Calls have realistic sizes: a request of ~8 KB of messages, ~2,000 prompt ids, ~200 completion ids with their
logprobs and a chat.completion response (~19 KB a row once stored). Bodies are serialized once into a pool and
copied in SQL (INSERT ... SELECT): the database stores and compresses every row's values on its own but parses
the JSON only once; the other tables go in with COPY (executemany on SQLite). Every step has ~45 metrics; every
rollout a `call.recorded` and a `rollout.status` event, every step six more; the train rollouts of the last
tenth of the steps have a Sample.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable
from unittest import mock

POOL = 64  # distinct bodies of each kind; rows cycle through them (TOAST compresses each value on its own)
WORDS = [f"{a}{b}{c}" for a in ("ka", "lo", "mer", "tis", "ub", "zan", "or", "pe") for b in ("ri", "sta", "vo", "gle",
         "n", "dra", "mu", "xe") for c in ("", "s", "ed", "ing", "ly", "tion", "er", "al")]


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
            " retried, created_at) "
            "SELECT r.id, s.seq, 'chat', %s, b.request, b.response, b.prompt_ids, b.completion_ids, b.logprobs,"
            " 'stop', 200, 300 + (r.id * 31 + s.seq) %% 900, r.policy_version, 'clean', '{}', '', false,"
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
        sampled = [[-rng.expovariate(4.0) for _ in range(300)] for _ in range(8)]
        self.sample_logprobs = [json.dumps([0.0] * 2000 + lps) for lps in sampled]
        self.sample_trainer_logprobs = [json.dumps([None] * 2000 + [lp - rng.uniform(0, 0.05) for lp in lps])
                                        for lps in sampled]
        self.sample_spans = json.dumps([[0, 0, 2000, False], [0, 2000, 2300, True]])
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
           "loss/total", "mismatch/kl", "reward/mean", "reward/pass_rate", "reward/std",
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


BIG = Shape(steps=100, groups=10, group_size=8, eval_every=5, eval_rollouts=100)
"""10,000 rollouts (100,000 calls): 8,000 training ones and 20 evaluations of the 100 val tasks."""
SMALL = Shape(steps=90, groups=1, group_size=1, eval_every=45, eval_rollouts=5)
"""About as many steps as BIG, so about as many metrics and step events: the two differ in rollouts and calls."""


def seed_owner(name: str):
    """A user with a harness, a dataset of 1,000 tasks and a reward script, through the services."""
    from django.contrib.auth import get_user_model

    from catalog import services as catalog_services

    user = get_user_model().objects.create_user(name, password=f"{name}-password-123")
    rng = random.Random(1)
    tasks = [{"id": f"task-{i:04d}", "question": text(rng, 300), "answer": str(rng.randrange(1000)),
              "split": "val" if i % 10 == 0 else "train"} for i in range(1000)]
    dataset = catalog_services.create_dataset(user, name="tasks", content="\n".join(map(json.dumps, tasks)).encode(),
                                      filename="tasks.jsonl", split_field="split")
    harness = catalog_services.create_harness(user, name="agent", command=["python", "agent.py", "{task_file}",
                                                                   "{output_file}"])
    reward = catalog_services.create_reward_script(user, name="exact", source="def reward(task, outcome):\n"
                                           "    return float(outcome.get('answer') == task.get('answer'))\n")
    return user, harness, dataset, reward


def seed_run(owner, harness, dataset, reward, shape: Shape, name: str, bodies: Bodies) -> int:
    """A run of `shape` with its rollouts, calls, metrics, events and samples; its id."""
    from catalog.models import Task
    from runs import services
    from runs.models import Metric, Rollout, Run, RunEvent, Sample

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
                                         at(step, 200)))
    Rollout.objects.bulk_create(rollouts, batch_size=1000)
    started_calls = time.perf_counter()
    calls = insert_calls(run.pk, shape.calls)
    print(f"  {name}: {calls} calls in {time.perf_counter() - started_calls:.1f} s", flush=True)
    trained = [r for r in rollouts if r.split == "train" and r.step > shape.steps - max(1, shape.steps // 10)]
    samples = [(r.pk, 0, bodies.sample_tokens[r.pk % 8], bodies.sample_mask[r.pk % 8],
                bodies.sample_logprobs[r.pk % 8], bodies.sample_trainer_logprobs[r.pk % 8], rng.uniform(-1, 1),
                json.dumps(list(range(shape.calls))), bodies.sample_spans, r.step, "merged", r.policy_version,
                r.finished_at) for r in trained]
    load_rows(Sample, ["rollout", "index", "token_ids", "loss_mask", "logprobs", "trainer_logprobs", "advantage",
                       "call_seqs", "spans", "step", "build", "policy_version", "created_at"], samples)
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
    trained = split == "train"
    return Rollout(run=run, task_id=task, split=split, step=step, group=group, attempt=attempt, greedy=greedy,
                   batch_step=step if trained else None, trained_step=step if trained else None, policy_version=step - 1, status="failed" if failed else "succeeded", reward=reward,
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


# ---- what the inspector's pages read: a 50-call rollout, an 8k-token sample, a 100-task x 20-evaluation grid --

INSPECT_CALLS = 50
INSPECT_SAMPLE_TOKENS = 8192


def seed_inspected_rollout(run_id: int, vocab_size: int, seed: int = 0) -> tuple[int, int]:
    """A train rollout of the run with INSPECT_CALLS chat calls (a tool call and its result each, the history
    resent every call, as an agent does) and one merged sample of INSPECT_SAMPLE_TOKENS tokens over all of them,
    ids below `vocab_size` (the run model's tokenizer decodes them): (rollout id, sample id)."""
    from runs.models import ModelCall, Rollout, Run, Sample

    rng = random.Random(seed)
    run = Run.objects.get(pk=run_id)
    last = Rollout.objects.filter(run=run, split="train").order_by("-step", "-group").first()
    step = last.step if last else 1
    begin = datetime.now(timezone.utc) - timedelta(minutes=30)
    rollout = Rollout.objects.create(
        run=run, task=last.task if last else None, split="train", step=step, batch_step=step, trained_step=step,
        group=(last.group + 1) if last else 0, attempt=0, policy_version=step - 1, status="succeeded", reward=1.0,
        reward_detail={"reward": 1.0}, exit_code=0, stdout_tail=text(rng, 2000), call_count=INSPECT_CALLS,
        started_at=begin, finished_at=begin + timedelta(seconds=600))
    tools = [{"type": "function", "function": {"name": name, "description": text(rng, 120),
                                                "parameters": {"type": "object", "properties": {
                                                    "code": {"type": "string"}}}}}
             for name in ("python", "bash", "read_file", "write_file")]
    messages = [{"role": "system", "content": text(rng, 1500)}, {"role": "user", "content": text(rng, 600)}]
    per_call = INSPECT_SAMPLE_TOKENS // INSPECT_CALLS
    calls, spans, token_ids, mask, logprobs, trainer = [], [], [], [], [], []
    for seq in range(INSPECT_CALLS):
        name = tools[seq % len(tools)]["function"]["name"]
        answer = {"role": "assistant", "content": text(rng, 200), "tool_calls": [{
            "id": f"call_{seq}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"code": text(rng, 150)})}}]}
        context, completion = per_call // 2, per_call - per_call // 2
        start = len(token_ids)
        token_ids += [rng.randrange(vocab_size) for _ in range(per_call)]
        mask += [0] * context + [1] * completion
        sampled = [-rng.expovariate(4.0) for _ in range(completion)]
        logprobs += [0.0] * context + sampled
        trainer += [None] * context + [lp - rng.uniform(0, 0.05) for lp in sampled]
        spans += [[seq, start, start + context, False], [seq, start + context, start + per_call, True]]
        calls.append(ModelCall(
            rollout=rollout, seq=seq, api="chat", request={"model": "policy", "messages": list(messages),
                                                           "tools": tools, "temperature": 1.0},
            response={"id": f"chatcmpl-{seq}", "object": "chat.completion", "model": "policy",
                      "choices": [{"index": 0, "finish_reason": "tool_calls", "message": answer}],
                      "usage": {"prompt_tokens": start + context, "completion_tokens": completion}},
            prompt_ids=token_ids[:start + context], completion_ids=token_ids[start + context:start + per_call],
            logprobs=sampled, finish_reason="tool_calls", status_code=200, latency_ms=400 + rng.random() * 800,
            policy_version=step - 1, drift="clean"))
        messages += [answer, {"role": "tool", "tool_call_id": f"call_{seq}", "content": text(rng, 300)}]
    ModelCall.objects.bulk_create(calls, batch_size=10)
    sample = Sample.objects.create(
        rollout=rollout, index=0, token_ids=token_ids, loss_mask=mask, logprobs=logprobs, trainer_logprobs=trainer,
        advantage=0.5, call_seqs=list(range(INSPECT_CALLS)), spans=spans, build="merged", step=step,
        policy_version=step - 1)
    return rollout.pk, sample.pk


def seed_inspector_run(owner, harness, dataset, reward, evaluations: int = 20, tasks: int = 100,
                       groups: int = 10, group_size: int = 8, calls: int = 10, seed: int = 0) -> int:
    """The small side of the validation grid and the step page: a running run of only what those pages read, at the
    big run's sizes (`tasks` val tasks at `evaluations` evaluations, one call each; step 1 of `groups` x
    `group_size` trained rollouts of `calls` calls, with its samples and its phase and metrics events). The big
    run holds the same grid and steps of the same shape among 100,000 calls: a page must not pay for those."""
    from catalog.models import Task
    from runs import services
    from runs.models import Metric, ModelCall, Rollout, Run, RunEvent, Sample

    with mock.patch.object(services, "enqueue_run", lambda run_id: None):
        run = services.create_run(owner, name="inspector", model="tiny", reward_script=reward, harness=harness,
                                  dataset=dataset, config={"steps": evaluations * 5 + 10, "eval_every": 5,
                                                           "tasks_per_step": groups, "group_size": group_size})
    rng = random.Random(seed)
    val = list(Task.objects.filter(dataset=dataset, split="val").values_list("pk", flat=True))[:tasks]
    train = list(Task.objects.filter(dataset=dataset, split="train").values_list("pk", flat=True))
    begin = datetime.now(timezone.utc) - timedelta(hours=3)
    at = lambda seconds: begin + timedelta(seconds=seconds)  # noqa: E731
    rows = [Rollout(run=run, task_id=task, split="val", step=step, group=index, attempt=0, policy_version=step,
                    status="succeeded", reward=float(rng.random() < 0.3 + step / 200), exit_code=0, call_count=1,
                    started_at=at(step * 60), finished_at=at(step * 60 + 30))
            for step in range(5, evaluations * 5 + 1, 5) for index, task in enumerate(val)]
    trained = [Rollout(run=run, task_id=train[group], split="train", step=0, batch_step=1, trained_step=1,
                       group=group, attempt=attempt, policy_version=0, status="succeeded", reward=float(rng.random() < 0.5),
                       exit_code=0, call_count=calls, started_at=at(5), finished_at=at(rng.uniform(20, 120)))
               for group in range(groups) for attempt in range(group_size)]
    Rollout.objects.bulk_create(rows + trained, batch_size=1000)
    ModelCall.objects.bulk_create(
        [ModelCall(rollout=r, seq=0, api="chat", request={"messages": []}, status_code=200) for r in rows]
        + [ModelCall(rollout=r, seq=seq, api="chat", request={"messages": []}, status_code=200, drift="clean")
           for r in trained for seq in range(calls)], batch_size=1000)
    Sample.objects.bulk_create([Sample(rollout=r, index=0, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                                       logprobs=[0.0, -0.5, -0.5], advantage=rng.uniform(-1, 1), step=1,
                                       call_seqs=list(range(calls)), build="merged") for r in trained])
    Metric.objects.bulk_create([Metric(run=run, step=1, name="reward/mean", value=0.5)])
    phases = ["step 1: generating rollouts", f"step 1: training on {len(trained)} rollouts",
              "step 1: syncing weights to the engine", "step 1: recording"]
    last = Run.objects.values_list("event_seq", flat=True).get(pk=run.pk)  # create_run's event
    events = [RunEvent(run=run, seq=last + 1 + k, kind="run.phase", payload={"phase": phase, "progress": None},
                       created_at=at(5 + 40 * k)) for k, phase in enumerate(phases)]
    events.append(RunEvent(run=run, seq=last + 1 + len(phases), kind="run.metrics",
                           payload={"step": 1, "values": {"reward/mean": 0.5}}, created_at=at(200)))
    RunEvent.objects.bulk_create(events)
    Run.objects.filter(pk=run.pk).update(status="running", step=evaluations * 5, policy_version=evaluations * 5,
                                         started_at=begin, event_seq=events[-1].seq)
    return run.pk


def drop_bodies() -> None:
    """Drop the pool tables load_bodies made."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE bench_bodies")
        cursor.execute("DROP TABLE bench_seqs")


def seed_big_run(shape: Shape = BIG, owner_name: str = "big", name: str = "big run"):
    """A new user `owner_name` (with a harness, a dataset and a reward script) and their run of `shape`, seeded
    into the current database: (user, run id)."""
    started = time.perf_counter()
    bodies = Bodies()
    load_bodies(bodies)
    try:
        user, harness, dataset, reward = seed_owner(owner_name)
        run = seed_run(user, harness, dataset, reward, shape, name, bodies)
    finally:
        drop_bodies()
    print(f"seeded run {run} ({shape.rollouts} rollouts, {shape.rollouts * shape.calls} calls) in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return user, run
