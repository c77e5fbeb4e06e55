"""rollout_services.record_step: a training step stored with a fixed number of queries, in short transactions; written
once when retried after a dropped connection, and only by the worker start that holds the run."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runs import reconnect, rollout_services, services
from runs.models import Metric, ModelCall, Rollout, Run, RunEvent, Sample
from tests.runs.test_reconnect import cut_own_connection

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
    """Record one step of one sample per rollout, every call classified, as the worker start holding the run does;
    return the SQL it issued."""
    drift = {r.pk: {seq: KINDS[(r.pk + seq) % 3] for seq in range(3)} for r in rollouts}
    Run.objects.filter(pk=run.pk).update(status="running", worker_starts=1)
    with CaptureQueriesContext(connection) as queries:
        rollout_services.record_step(run.pk, number, number, [sample(r, i) for i, r in enumerate(rollouts)], drift,
                                     {"loss/policy": 0.25, "reward/mean": 0.5}, generation=1)
    return [q["sql"] for q in queries.captured_queries]


def statements(sql):
    """The queries that read or write rows (savepoints are how atomic blocks nest inside the test's transaction)."""
    return [q for q in sql if "SAVEPOINT" not in q.upper()]


def test_the_number_of_queries_does_not_grow_with_the_rollouts(alice, make_run):
    small, large = make_run(alice, name="small"), make_run(alice, name="large")
    small_sql = step(small, rollouts_with_calls(small, 32))
    large_sql = step(large, rollouts_with_calls(large, 64))
    # samples, calls to classify, drift, each with the run's row checked and locked (2), run row, metrics, and the
    # event (3): 10 at any size
    assert len(statements(small_sql)) == len(statements(large_sql)) == 10
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


def test_indexes_are_fixed_per_rollout_so_a_step_recorded_again_writes_nothing_twice(alice, make_run):
    run = make_run(alice)
    first, second = rollouts_with_calls(run, 2)
    samples = [sample(first, 1), sample(second, 2), sample(first, 3)]
    drift = {first.pk: {1: "fork"}, second.pk: {}}
    for _ in range(2):  # a retry after the first one's last transaction committed (its answer lost with the connection)
        rollout_services.record_step(run.pk, 1, 1, samples, drift, {"loss/policy": 0.5}, {first.pk: "", second.pk: ""})
    assert list(Sample.objects.order_by("rollout_id", "index").values_list("rollout_id", "index", "token_ids")) == [
        (first.pk, 0, [1, 2, 1]), (first.pk, 1, [1, 2, 3]), (second.pk, 0, [1, 2, 2])]
    assert list(ModelCall.objects.filter(rollout=first).order_by("seq").values_list("drift", flat=True)) == [
        "", "fork", ""]
    assert list(Metric.objects.filter(run=run).values_list("step", "name", "value")) == [(1, "loss/policy", 0.5)]
    assert RunEvent.objects.filter(run=run, kind="run.metrics").count() == 1
    assert Run.objects.get(pk=run.pk).step == 1


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


def test_the_steps_rollouts_get_their_batch_step_and_trained_step_or_drop_reason(alice, make_run):
    run = make_run(alice)
    trained, failed, empty, later = rollouts_with_calls(run, 4)
    rollout_services.record_step(run.pk, 3, 3, [sample(trained, 0) | {"step": 3, "spans": [[0, 0, 1, False]],
                                                                       "trainer_logprobs": [None, -0.4, -0.3]}], {},
                                 {}, {trained.pk: "", failed.pk: "infra_failure: engine refused", empty.pk:
                                      "no_sampled_tokens"})
    rows = {r.pk: (r.batch_step, r.trained_step, r.drop_reason, r.fate) for r in run.rollouts.all()}
    assert rows == {trained.pk: (3, 3, "", "sampled for step 3: trained"),
                    failed.pk: (3, None, "infra_failure: engine refused",
                                "sampled for step 3: dropped (infra_failure: engine refused)"),
                    empty.pk: (3, None, "no_sampled_tokens", "sampled for step 3: dropped (no_sampled_tokens)"),
                    later.pk: (None, None, "", "")}
    stored = Sample.objects.get(rollout=trained)
    assert (stored.step, stored.spans, stored.trainer_logprobs) == (3, [[0, 0, 1, False]], [None, -0.4, -0.3])


def held_run(alice, make_run, generation=2):
    """A running run held by worker start `generation`."""
    run = make_run(alice)
    Run.objects.filter(pk=run.pk).update(status="running", worker_starts=generation)
    return run


def assert_nothing_after_the_samples(run, rollouts):
    run.refresh_from_db()
    assert (run.step, run.policy_version) == (0, 0)
    assert not Metric.objects.filter(run=run).exists() and not RunEvent.objects.filter(run=run, kind="run.metrics")
    assert not ModelCall.objects.filter(rollout__run=run).exclude(drift="").exists()
    assert [(r.trained_step, r.drop_reason) for r in Rollout.objects.filter(run=run)] == [(None, "")] * len(rollouts)


def test_a_worker_start_that_no_longer_holds_the_run_writes_nothing(alice, make_run):
    run = held_run(alice, make_run, generation=2)  # another worker claimed it after worker start 1 stalled
    rollouts = rollouts_with_calls(run, 3)
    with pytest.raises(services.NotHeld, match=f"run {run.pk} is no longer held by worker start 1"):
        rollout_services.record_step(run.pk, 1, 1, [sample(r, i) for i, r in enumerate(rollouts)],
                                     {r.pk: {0: "fork"} for r in rollouts}, {"reward/mean": 0.5},
                                     {r.pk: "" for r in rollouts}, generation=1)
    assert not Sample.objects.filter(rollout__run=run).exists()
    assert_nothing_after_the_samples(run, rollouts)


def test_a_claim_by_another_worker_mid_record_stops_the_writes_that_follow(alice, make_run, monkeypatch):
    run = held_run(alice, make_run, generation=1)
    rollouts = rollouts_with_calls(run, 3)
    store_drift = rollout_services._store_drift

    def claimed_meanwhile(*args, **kwargs):  # worker start 1 stalled past LIGHTNING_RUN_LOST_AFTER_S here
        Run.objects.filter(pk=run.pk).update(worker_starts=2)
        return store_drift(*args, **kwargs)

    monkeypatch.setattr(rollout_services, "_store_drift", claimed_meanwhile)
    with pytest.raises(services.NotHeld):
        rollout_services.record_step(run.pk, 1, 1, [sample(r, i) for i, r in enumerate(rollouts)],
                                     {r.pk: {0: "fork"} for r in rollouts}, {"reward/mean": 0.5},
                                     {r.pk: "" for r in rollouts}, generation=1)
    assert Sample.objects.filter(rollout__run=run).count() == 3  # written while it held the run (the rewind drops them)
    assert_nothing_after_the_samples(run, rollouts)


@pytest.mark.django_db(transaction=True)  # a connection cut inside the test's transaction could not be retried
def test_a_connection_dropped_mid_record_is_retried_and_leaves_each_sample_once(alice, make_run, monkeypatch, caplog):
    if connection.vendor != "postgresql":
        pytest.skip("cuts a PostgreSQL connection")
    monkeypatch.setattr(services, "STEP_BATCH", 10)
    run = make_run(alice)
    rollouts = rollouts_with_calls(run, 32)
    store_drift, cuts = rollout_services._store_drift, []

    def cut_once(*args, **kwargs):  # the samples' batches are committed; the drift, batch and step are not
        if not cuts:
            cuts.append(Sample.objects.filter(rollout__run=run).count())
            cut_own_connection()
        return store_drift(*args, **kwargs)

    monkeypatch.setattr(rollout_services, "_store_drift", cut_once)
    drift = {r.pk: {seq: KINDS[(r.pk + seq) % 3] for seq in range(3)} for r in rollouts}
    reconnect.call_with_reconnect(rollout_services.record_step, run.pk, 1, 1,
                                  [sample(r, i) for i, r in enumerate(rollouts)], drift, {"reward/mean": 0.5},
                                  {r.pk: "" for r in rollouts})
    assert cuts == [32] and "database connection lost in record_step" in caplog.text
    assert list(Sample.objects.filter(rollout__run=run).order_by("rollout_id").values_list("rollout_id", "index")) == [
        (r.pk, 0) for r in rollouts]
    assert Run.objects.get(pk=run.pk).step == 1 and Metric.objects.filter(run=run).count() == 1
    assert ModelCall.objects.filter(rollout__run=run).exclude(drift="").count() == 96
    assert set(Rollout.objects.filter(run=run).values_list("trained_step", flat=True)) == {1}
    connection.close()
