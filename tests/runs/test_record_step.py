"""rollout_services.record_step: a training step stored with a fixed number of queries, in short transactions."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runs import rollout_services, services
from runs.models import Metric, ModelCall, Run, RunEvent, Sample

pytestmark = pytest.mark.django_db
KINDS = ("fork", "clean", "realign")


def rollouts_with_calls(run, count, calls=3):
    rollouts = [rollout_services.create_rollout(run, task=None, split="train", step=0, group=i, attempt=0)[0]
                for i in range(count)]
    ModelCall.objects.bulk_create([ModelCall(rollout=r, seq=seq, api="chat", request={}, status_code=200)
                                   for r in rollouts for seq in range(calls)])
    return rollouts


def sample(rollout, n):
    return {"rollout_id": rollout.pk, "token_ids": [1, 2, n], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.5, -0.25],
            "advantage": 0.5 * n, "call_seqs": [0, 1, 2], "build": "merged", "policy_version": 1}


def step(run, rollouts, number=1):
    """Record one step of one sample per rollout, every call classified; return the SQL it issued."""
    drift = {r.pk: {seq: KINDS[(r.pk + seq) % 3] for seq in range(3)} for r in rollouts}
    with CaptureQueriesContext(connection) as queries:
        rollout_services.record_step(run.pk, number, number, [sample(r, i) for i, r in enumerate(rollouts)], drift,
                                     {"loss/policy": 0.25, "reward/mean": 0.5})
    return [q["sql"] for q in queries.captured_queries]


def statements(sql):
    """The queries that read or write rows (savepoints are how atomic blocks nest inside the test's transaction)."""
    return [q for q in sql if "SAVEPOINT" not in q.upper()]


def test_the_number_of_queries_does_not_grow_with_the_rollouts(alice, make_run):
    small, large = make_run(alice, name="small"), make_run(alice, name="large")
    small_sql = step(small, rollouts_with_calls(small, 32))
    large_sql = step(large, rollouts_with_calls(large, 64))
    # sample indexes, samples, calls to classify, drift, run row, metrics, and the event (3): 9 at any size
    assert len(statements(small_sql)) == len(statements(large_sql)) == 9
    assert len(small_sql) == len(large_sql) <= 20


def test_rows_and_drift_are_stored(alice, make_run):
    run = make_run(alice)
    rollouts = rollouts_with_calls(run, 32)
    step(run, rollouts)
    run.refresh_from_db()
    assert (run.step, run.policy_version) == (1, 1)
    rows = Sample.objects.filter(rollout__run=run).order_by("rollout_id")
    assert [(s.rollout_id, s.index, s.token_ids, s.advantage) for s in rows] == [
        (r.pk, 0, [1, 2, i], 0.5 * i) for i, r in enumerate(rollouts)]
    assert {(c.rollout_id, c.seq): c.drift for c in ModelCall.objects.filter(rollout__run=run)} == {
        (r.pk, seq): KINDS[(r.pk + seq) % 3] for r in rollouts for seq in range(3)}
    assert dict(Metric.objects.filter(run=run, step=1).values_list("name", "value")) == {
        "loss/policy": 0.25, "reward/mean": 0.5}
    assert RunEvent.objects.filter(run=run, kind="run.metrics").get().payload["step"] == 1


def test_indexes_continue_from_earlier_steps_and_within_a_step(alice, make_run):
    run = make_run(alice)
    first, second = rollouts_with_calls(run, 2)
    rollout_services.record_step(run.pk, 1, 1, [sample(first, 0)], {}, {})
    rollout_services.record_step(run.pk, 2, 2, [sample(first, 1), sample(second, 2), sample(first, 3)],
                                 {first.pk: {1: "fork"}, second.pk: {}}, {})
    assert list(Sample.objects.order_by("rollout_id", "index").values_list("rollout_id", "index", "token_ids")) == [
        (first.pk, 0, [1, 2, 0]), (first.pk, 1, [1, 2, 1]), (first.pk, 2, [1, 2, 3]), (second.pk, 0, [1, 2, 2])]
    assert list(ModelCall.objects.filter(rollout=first).order_by("seq").values_list("drift", flat=True)) == [
        "", "fork", ""]
    assert Run.objects.get(pk=run.pk).step == 2


def test_writes_go_in_batches_of_step_batch_rows(alice, make_run, monkeypatch):
    monkeypatch.setattr(services, "STEP_BATCH", 10)
    run = make_run(alice)
    rollouts = rollouts_with_calls(run, 32)
    sql = step(run, rollouts)
    inserts = [q for q in sql if q.startswith('INSERT INTO "runs_sample"')]
    updates = [q for q in sql if q.startswith('UPDATE "runs_modelcall"')]
    assert len(inserts) == 4 and len(updates) == 10  # 32 samples and 96 calls, at most 10 rows each
    # each batch is its own atomic block: a savepoint released around every write
    releases = [q for q in sql if q.upper().startswith("RELEASE SAVEPOINT")]
    assert len(releases) >= len(inserts) + len(updates)
    assert Sample.objects.filter(rollout__run=run).count() == 32
    assert ModelCall.objects.filter(rollout__run=run).exclude(drift="").count() == 96


def test_the_steps_rollouts_get_their_trained_step_and_drop_reason(alice, make_run):
    run = make_run(alice)
    trained, failed, empty, later = rollouts_with_calls(run, 4)
    rollout_services.record_step(run.pk, 3, 3, [sample(trained, 0) | {"step": 3, "spans": [[0, 0, 1, False]],
                                                                       "trainer_logprobs": [None, -0.4, -0.3]}], {},
                                 {}, {trained.pk: "", failed.pk: "infra_failure: engine refused", empty.pk:
                                      "no_sampled_tokens"})
    rows = {r.pk: (r.trained_step, r.drop_reason) for r in run.rollouts.all()}
    assert rows == {trained.pk: (3, ""), failed.pk: (3, "infra_failure: engine refused"),
                    empty.pk: (3, "no_sampled_tokens"), later.pk: (None, "")}
    stored = Sample.objects.get(rollout=trained)
    assert (stored.step, stored.spans, stored.trainer_logprobs) == (3, [[0, 0, 1, False]], [None, -0.4, -0.3])
