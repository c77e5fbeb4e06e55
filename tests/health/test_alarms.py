"""health.services.check_step on stored steps: each alarm raised by the fault it watches for (with its evidence,
example rollouts, a run.alarm event and health/* metrics), and a clean run's steps raise none."""
import pytest

from health import services as health_services
from health.models import RunAlarm
from runs.models import Metric, RunEvent
from tests.health.steps import Attempt, clean_attempts, store_step

pytestmark = pytest.mark.django_db


def alarms(run, step=None):
    rows = RunAlarm.objects.filter(run=run, **({"step": step} if step is not None else {}))
    return sorted(rows.values_list("kind", flat=True))


def healthy_steps(run, steps=3):
    for step in range(1, steps + 1):
        store_step(run, step, clean_attempts(offset=0.05 * step))
        health_services.check_step(run.pk, step)


def test_a_clean_run_raises_no_alarm_and_records_its_health_metrics(alice, make_run):
    run = make_run(alice)
    healthy_steps(run, 4)
    health_services.check_evaluation(run.pk, 4)
    assert alarms(run) == []
    assert not RunEvent.objects.filter(run=run, kind="run.alarm").exists()
    values = dict(Metric.objects.filter(run=run, step=4, name__startswith="health/").values_list("name", "value"))
    assert values == {"health/tool_use_share": 1.0, "health/offered_tools_share": 1.0,
                      "health/text_tool_call_share": 0.0, "health/format_error_share": 0.0,
                      "health/empty_rollouts": 0.0, "health/truncated_share": 0.0, "health/flagged_rollouts": 0.0}


def test_no_tool_calls_while_the_harness_offers_tools(alice, make_run):
    run = make_run(alice)
    healthy_steps(run, 2)
    rollouts = store_step(run, 3, [[Attempt(reward=0.1 * a, tool_call=False) for a in range(4)] for _ in range(4)])
    raised = health_services.check_step(run.pk, 3)
    assert [a.kind for a in raised] == ["no_tool_calls"]
    alarm = raised[0]
    assert alarm.severity == "critical" and alarm.step == 3
    assert alarm.evidence["tool_use_share"] == 0.0 and alarm.evidence["earlier_max"] == 1.0
    assert alarm.rollout_ids == [r.pk for r in rollouts[:5]]
    event = RunEvent.objects.get(run=run, kind="run.alarm")
    assert event.payload["kind"] == "no_tool_calls" and event.payload["id"] == alarm.pk
    assert not event.payload["acknowledged"]


def test_no_commands_after_earlier_steps_used_them_without_tools_offered(alice, make_run):
    """A text-command harness (mini-SWE-agent style): it reports the commands it ran in its outcome."""
    run = make_run(alice)
    for step in (1, 2):
        store_step(run, step, [[Attempt(reward=0.1 * a, tool_call=False, offer_tools=False,
                                        outcome={"commands": 2}) for a in range(4)] for _ in range(4)])
        assert health_services.check_step(run.pk, step) == []
    store_step(run, 3, [[Attempt(reward=0.1 * a, tool_call=False, offer_tools=False, outcome={"commands": 0})
                         for a in range(4)] for _ in range(4)])
    assert [a.kind for a in health_services.check_step(run.pk, 3)] == ["no_tool_calls"]


def test_a_run_that_never_offered_or_used_tools_is_not_alarmed_for_it(alice, make_run):
    run = make_run(alice)
    for step in (1, 2):
        store_step(run, step, [[Attempt(reward=0.1 * a, tool_call=False, offer_tools=False) for a in range(4)]
                               for _ in range(4)])
        assert health_services.check_step(run.pk, step) == []


def test_tool_calls_written_as_text(alice, make_run):
    run = make_run(alice)
    healthy_steps(run, 1)
    text = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    store_step(run, 2, [[Attempt(reward=0.1 * a, tool_call=a < 2, text=text) for a in range(4)] for _ in range(4)])
    raised = health_services.check_step(run.pk, 2)
    assert [a.kind for a in raised] == ["unparsed_tool_text"]
    assert raised[0].evidence["text_tool_call_share"] == 0.5


def test_replies_the_harness_refused_as_malformed(alice, make_run):
    run = make_run(alice)
    store_step(run, 1, [[Attempt(reward=0.1 * a, outcome={"commands": 1, "format_errors": 2 if a else 0})
                         for a in range(4)] for _ in range(4)])
    raised = health_services.check_step(run.pk, 1)
    assert [a.kind for a in raised] == ["unparsed_tool_text"]
    assert raised[0].evidence["format_error_share"] == 0.75


@pytest.mark.parametrize("fault, reason", [
    (dict(calls=0), "no calls"),
    (dict(completion_tokens=0), "no sampled tokens"),
    (dict(masked=True), "every sample fully masked"),
])
def test_empty_rollouts(alice, make_run, fault, reason):
    run = make_run(alice)
    groups = clean_attempts()
    groups[1][2] = Attempt(reward=0.2, **fault)
    rollouts = store_step(run, 1, groups)
    raised = health_services.check_step(run.pk, 1)
    assert [a.kind for a in raised] == ["empty_rollouts"]
    assert raised[0].evidence["reasons"] == {reason: 1}
    assert raised[0].rollout_ids == [rollouts[6].pk]


def test_groups_without_signal(alice, make_run):
    run = make_run(alice)
    groups = [[Attempt(reward=float(g % 2)) for _ in range(4)] for g in range(4)]  # flat groups, rewards 0 and 1
    store_step(run, 1, groups)
    raised = health_services.check_step(run.pk, 1)
    assert [a.kind for a in raised] == ["no_signal"]
    assert raised[0].evidence == {"share": 1.0, "groups": 4, "flat_groups": 4, "dropped_groups": 0,
                                  "dynamic_sampling": False}
    assert raised[0].message == ("100% of the 4 groups this step trained on scored every attempt the same: GRPO "
                                 "learns nothing from them. Raise temperature or group_size, or turn on "
                                 "dynamic_sampling.")


def flat(reward, size=4):
    return [Attempt(reward=reward) for _ in range(size)]


def test_groups_dynamic_sampling_dropped_are_not_counted(alice, make_run):
    """Dynamic sampling did its work: the flat groups it dropped were replaced by groups with signal."""
    run = make_run(alice, config={"dynamic_sampling": True, "dynamic_sampling_max_extra": 4.0, "tasks_per_step": 1})
    store_step(run, 1, clean_attempts(groups=1) + [flat(1.0), flat(0.0), flat(1.0), flat(0.0)], dropped=4)
    assert health_services.check_step(run.pk, 1) == []
    assert not RunAlarm.objects.filter(run=run).exists()


def test_flat_groups_trained_once_dynamic_samplings_budget_ran_out(alice, make_run):
    run = make_run(alice, config={"dynamic_sampling": True, "dynamic_sampling_max_extra": 0.8,
                                  "tasks_per_step": 5})
    trained = [flat(1.0), flat(0.0), flat(1.0), flat(0.0), clean_attempts(groups=1)[0]]
    rollouts = store_step(run, 1, trained + [flat(0.0)] * 4, dropped=4)
    raised = health_services.check_step(run.pk, 1)
    assert [a.kind for a in raised] == ["no_signal"]
    assert raised[0].evidence == {"share": 0.8, "groups": 5, "flat_groups": 4, "dropped_groups": 4,
                                  "dynamic_sampling": True}
    assert raised[0].message == (
        "80% of the 5 groups this step trained on scored every attempt the same: GRPO learns nothing from them. "
        "Dynamic sampling is on (at most 4 groups dropped a step: dynamic_sampling_max_extra x tasks_per_step) and "
        "dropped 4 this step; these came once its budget was spent: raise dynamic_sampling_max_extra, or temperature "
        "or group_size.")
    assert raised[0].rollout_ids == [rollouts[0].pk, rollouts[4].pk, rollouts[8].pk, rollouts[12].pk]  # trained only


def test_reward_collapse_raises_it_and_the_signal_alarm(alice, make_run):
    run = make_run(alice)
    store_step(run, 1, [[Attempt(reward=1.0) for _ in range(4)] for _ in range(4)])
    raised = {a.kind: a for a in health_services.check_step(run.pk, 1)}
    assert sorted(raised) == ["no_signal", "reward_collapse"]
    assert raised["reward_collapse"].evidence == {"reward": 1.0, "rollouts": 16}


def test_logprob_mismatch_above_the_threshold(alice, make_run):
    run = make_run(alice)
    store_step(run, 1, clean_attempts(), metrics={"train/logprob_mismatch_mean": 0.9})
    assert [a.kind for a in health_services.check_step(run.pk, 1)] == ["logprob_mismatch"]


def test_logprob_mismatch_jumping_after_a_weight_sync(alice, make_run):
    run = make_run(alice)
    healthy_steps(run, 3)  # 0.01 each
    store_step(run, 4, clean_attempts(), metrics={"train/logprob_mismatch_mean": 0.08})
    raised = health_services.check_step(run.pk, 4)
    assert [a.kind for a in raised] == ["logprob_mismatch"]
    assert raised[0].evidence["earlier_median"] == 0.01


def test_train_reward_up_while_validation_falls(alice, make_run):
    run = make_run(alice)
    for step, (reward, val) in enumerate([(0.2, 0.5), (0.3, None), (0.5, 0.4)], start=1):
        store_step(run, step, clean_attempts(), metrics={"reward/mean": reward, **(
            {"eval/pass@1": val, "eval/tasks": 50} if val is not None else {})})
        assert health_services.check_step(run.pk, step) == []  # the rule waits for the evaluation
    raised = health_services.check_evaluation(run.pk, 3)
    assert [a.kind for a in raised] == ["reward_up_val_down"]
    assert raised[0].evidence == {"from_step": 1, "to_step": 3, "val_before": 0.5, "val_after": 0.4,
                                  "reward_rise": pytest.approx(0.3)}


def test_an_evaluation_of_a_few_tasks_is_too_noisy_for_it(alice, make_run):
    run = make_run(alice)
    for step, (reward, val) in enumerate([(0.2, 0.5), (0.5, 0.0)], start=1):
        store_step(run, step, clean_attempts(), metrics={"reward/mean": reward, "eval/pass@1": val, "eval/tasks": 2})
        health_services.check_evaluation(run.pk, step)
    assert alarms(run) == []


def test_validation_falling_with_the_train_reward_is_not_this_alarm(alice, make_run):
    run = make_run(alice)
    for step, (reward, val) in enumerate([(0.5, 0.5), (0.3, 0.4)], start=1):
        store_step(run, step, clean_attempts(), metrics={"reward/mean": reward, "eval/pass@1": val})
        health_services.check_evaluation(run.pk, step)
    assert alarms(run) == []


@pytest.mark.parametrize("fault", [dict(finish_reason="length"), dict(error="the harness timed out after 60 s",
                                                                      failure_kind="policy")])
def test_truncations_or_timeouts_rising(alice, make_run, fault):
    run = make_run(alice)
    healthy_steps(run, 2)
    groups = clean_attempts()
    for g in range(2):
        groups[g] = [Attempt(reward=0.1 * a, **fault) for a in range(4)]
    store_step(run, 3, groups)
    raised = health_services.check_step(run.pk, 3)
    assert [a.kind for a in raised] == ["truncation_rising"]
    assert raised[0].evidence == {"share": 0.5, "earlier_mean": 0.0}


def test_a_run_cut_off_from_its_first_step_on_is_not_rising(alice, make_run):
    run = make_run(alice)
    for step in (1, 2):
        store_step(run, step, [[Attempt(reward=0.1 * a, finish_reason="length") for a in range(4)] for _ in range(4)])
        assert health_services.check_step(run.pk, step) == []
    assert Metric.objects.get(run=run, step=2, name="health/truncated_share").value == 1.0


def test_rollouts_flagged_by_the_reward_hacking_lens(alice, make_run):
    run = make_run(alice)
    groups = clean_attempts()
    groups[2][1] = Attempt(reward=1.0, flags=[{"kind": "test_edit", "evidence": "changed test_cart.py"}])
    rollouts = store_step(run, 1, groups)
    raised = health_services.check_step(run.pk, 1)
    assert [a.kind for a in raised] == ["reward_hacking"]
    assert raised[0].evidence == {"flagged": 1, "kinds": {"test_edit": 1}}
    assert raised[0].rollout_ids == [rollouts[9].pk]
    assert Metric.objects.get(run=run, step=1, name="health/flagged_rollouts").value == 1.0


def test_a_step_checked_twice_raises_its_alarms_once(alice, make_run):
    run = make_run(alice)
    store_step(run, 1, [[Attempt(reward=1.0) for _ in range(4)] for _ in range(4)])
    assert len(health_services.check_step(run.pk, 1)) == 2
    assert health_services.check_step(run.pk, 1) == []
    assert RunAlarm.objects.filter(run=run).count() == 2
    assert RunEvent.objects.filter(run=run, kind="run.alarm").count() == 2


def test_thresholds_come_from_the_run_config(alice, make_run):
    run = make_run(alice, config={"health": {"no_signal_share": 1.0, "min_rollouts": 100}})
    store_step(run, 1, [[Attempt(reward=1.0) for _ in range(4)] for _ in range(4)])
    assert health_services.check_step(run.pk, 1) == []


def test_a_failing_check_is_logged_and_does_not_stop_the_run(alice, make_run, caplog):
    import asyncio

    def broken(run_id, step):
        raise RuntimeError("boom")

    asyncio.run(health_services.in_run(broken, 1, 2))
    assert "health check broken failed" in caplog.text


def test_a_steps_check_takes_the_same_queries_however_many_rollouts(alice, make_run):
    """step_facts' promise: a few queries per STEP_BATCH rollouts, never one per rollout or call."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    counts = []
    for groups in (2, 8):
        run = make_run(alice, name=f"size-{groups}")
        store_step(run, 1, clean_attempts(groups=groups))
        with CaptureQueriesContext(connection) as queries:
            health_services.check_step(run.pk, 1)
        counts.append(len([q for q in queries.captured_queries if "SAVEPOINT" not in q["sql"].upper()]))
        assert Metric.objects.filter(run=run, step=1, name="health/tool_use_share").get().value == 1.0
    assert counts[0] == counts[1] <= 12
