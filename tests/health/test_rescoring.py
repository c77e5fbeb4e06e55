"""Re-scoring a run's stored rollouts: the API and pages start it, the job scores each stored outcome with the new
script, and the run's own record is untouched; the page shows old and new reward and Pass@1 side by side."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from health import rescoring
from health.models import Rescore, RescoredRollout
from runs import rollout_services
from runs.models import Rollout, RolloutStatus

pytestmark = pytest.mark.django_db

LENIENT = '''
def reward(task, outcome):
    # Half credit for an answer one off: the new version of the exact-match script.
    got, want = outcome.get("answer"), task.get("answer")
    if got == want:
        return 1.0
    return 0.5 if isinstance(got, int) and abs(got - want) == 1 else 0.0
'''


def scored_run(alice, make_run):
    """A run with 4 train rollouts at step 1 (answers right, one off, wrong, and a policy failure), 2 val rollouts
    evaluated at step 1 (right, one off), one infrastructure failure and one without a stored outcome."""
    run = make_run(alice)
    tasks = {t.split: t for t in run.dataset.tasks.all()}  # t0 is val (answer 1), t1.. train
    train, val = run.dataset.tasks.filter(split="train").first(), tasks["val"]
    made = []

    def rollout(task, split, step, answer, reward, kind="", outcome=True, attempt=0):
        r = rollout_services.create_rollout(run, task=task, split=split, step=step, group=0, attempt=attempt)[0]
        rollout_services.finish_rollout(
            r.pk, status=RolloutStatus.FAILED if kind else RolloutStatus.SUCCEEDED, reward=reward, reward_detail={},
            exit_code=0, failure_kind=kind, outcome={"answer": answer} if outcome else None)
        Rollout.objects.filter(pk=r.pk).update(batch_step=step + 1 if split == "train" else None,
                                               trained_step=step + 1 if split == "train" else None)
        made.append(r)
        return r

    want = train.data["answer"]
    rollout(train, "train", 0, want, 1.0, attempt=0)
    rollout(train, "train", 0, want + 1, 0.0, attempt=1)
    rollout(train, "train", 0, 99, 0.0, attempt=2)
    rollout(train, "train", 0, want + 1, 0.0, kind="policy", attempt=3)
    rollout(val, "val", 1, 1, 1.0, attempt=0)
    rollout(val, "val", 1, 2, 0.0, attempt=1)
    rollout(train, "train", 0, want, None, kind="infra", attempt=4)  # never scored: left out
    rollout(train, "train", 0, want, 1.0, outcome=False, attempt=5)  # recorded before outcomes were kept
    Rollout.objects.filter(pk=made[-1].pk).update(outcome={})
    return run, made


def test_the_api_starts_a_rescore_that_scores_every_stored_outcome(alice, alice_api, make_run, make_reward):
    run, made = scored_run(alice, make_run)
    before = list(Rollout.objects.filter(run=run).order_by("id").values_list("reward", "reward_detail", "outcome"))
    script = make_reward(alice, name="lenient", source=LENIENT)
    response = alice_api.post(f"/api/v1/runs/{run.pk}/rescores/", {"reward_script": script.pk}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["status"], body["scope"], body["total"], body["reward_script_name"]) == ("queued", "all", 7, "lenient")
    assert rescoring.run_rescore(body["id"]) == "succeeded"

    detail = alice_api.get(f"/api/v1/runs/{run.pk}/rescores/{body['id']}/").json()
    assert detail["status"] == "succeeded" and detail["done"] == 7 and detail["results_count"] == 7
    new = {row["rollout"]: (row["old_reward"], row["new_reward"], row["changed"]) for row in detail["results"]}
    assert new == {made[0].pk: (1.0, 1.0, False), made[1].pk: (0.0, 0.5, True), made[2].pk: (0.0, 0.0, False),
                   made[3].pk: (0.0, 0.0, False),  # a policy failure keeps the failure reward
                   made[4].pk: (1.0, 1.0, False), made[5].pk: (0.0, 0.5, True),
                   made[7].pk: (1.0, 0.0, True)}  # {} stored: the exact script's answer is missing -> 0
    policy = RescoredRollout.objects.get(rollout=made[3])
    assert policy.detail == {"script_reward": 0.5}
    summary = detail["summary"]
    assert (summary["scored"], summary["errors"], summary["changed"]) == (7, 0, 3)
    assert summary["splits"]["train"] == {"rollouts": 5, "old_mean": 0.4, "new_mean": pytest.approx(0.3),
                                          "old_pass1": 0.4, "new_pass1": 0.2}
    assert summary["val_by_step"] == [{"step": 1, "rollouts": 2, "old_mean": 0.5, "new_mean": 0.75,
                                       "old_pass1": 0.5, "new_pass1": 0.5}]
    # nothing of the run's record changed
    assert list(Rollout.objects.filter(run=run).order_by("id").values_list("reward", "reward_detail",
                                                                             "outcome")) == before
    changed_only = alice_api.get(f"/api/v1/runs/{run.pk}/rescores/{body['id']}/?changed=1").json()
    assert sorted(row["rollout"] for row in changed_only["results"]) == sorted([made[1].pk, made[5].pk, made[7].pk])


def test_a_rollout_whose_outcome_was_not_kept_is_an_error_not_a_score(alice, make_run, make_reward):
    run, made = scored_run(alice, make_run)
    Rollout.objects.filter(pk=made[0].pk).update(outcome={"_not_stored": "2000000 bytes, over the 1000000 kept"})
    rescore = rescoring.start_rescore(alice, run, make_reward(alice, name="lenient", source=LENIENT))
    rescoring.run_rescore(rescore.pk)
    result = RescoredRollout.objects.get(rescore=rescore, rollout=made[0])
    assert result.new_reward is None and "not kept" in result.error
    rescore.refresh_from_db()
    assert (rescore.summary["scored"], rescore.summary["errors"]) == (6, 1)


def test_scopes_step_and_flagged(alice, make_run, make_reward):
    run, made = scored_run(alice, make_run)
    script = make_reward(alice, name="lenient", source=LENIENT)
    assert rescoring.start_rescore(alice, run, script, "step", 1).total == 7  # train batch of step 1 and val at 1
    Rollout.objects.filter(pk=made[2].pk).update(flags=[{"kind": "test_edit", "evidence": "x"}])
    flagged = rescoring.start_rescore(alice, run, script, "flagged")
    rescoring.run_rescore(flagged.pk)
    assert list(RescoredRollout.objects.filter(rescore=flagged).values_list("rollout_id", flat=True)) == [made[2].pk]


@pytest.mark.parametrize("body, message", [
    ({"scope": "step"}, "scope 'step' needs a step"),
    ({"scope": "all", "step": 3}, "only given with scope 'step'"),
    ({"scope": "step", "step": 40}, "no scored rollouts step 40"),
    ({"scope": "flagged"}, "no scored rollouts flagged"),
])
def test_bad_requests_are_400s_that_say_why(alice, alice_api, make_run, make_reward, body, message):
    run, _ = scored_run(alice, make_run)
    script = make_reward(alice, name="lenient", source=LENIENT)
    response = alice_api.post(f"/api/v1/runs/{run.pk}/rescores/", {"reward_script": script.pk, **body}, format="json")
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert not Rescore.objects.exists()


def test_another_users_run_or_script_is_not_found(alice, bob, alice_api, bob_api, make_run, make_reward):
    run, _ = scored_run(alice, make_run)
    bobs = make_reward(bob, name="bobs")
    assert bob_api.post(f"/api/v1/runs/{run.pk}/rescores/", {"reward_script": bobs.pk}, format="json"
                        ).status_code == 404
    response = alice_api.post(f"/api/v1/runs/{run.pk}/rescores/", {"reward_script": bobs.pk}, format="json")
    assert response.status_code == 400 and "reward_script" in response.json()["error"]["fields"]
    assert not Rescore.objects.exists()


def test_a_job_whose_worker_died_is_done_by_the_message_delivered_again(alice, make_run, make_reward):
    """The worker claimed it (running) and died before writing anything; acks_late delivers the message again."""
    run, made = scored_run(alice, make_run)
    rescore = rescoring.start_rescore(alice, run, make_reward(alice, name="lenient", source=LENIENT))
    Rescore.objects.filter(pk=rescore.pk).update(status="running", done=4)
    assert rescoring.run_rescore(rescore.pk) == "succeeded"
    rescore.refresh_from_db()
    assert (rescore.status, rescore.done, rescore.summary["changed"]) == ("succeeded", 7, 3)
    assert RescoredRollout.objects.filter(rescore=rescore).count() == 7


def test_of_two_deliveries_the_second_to_finish_writes_nothing(alice, make_run, make_reward):
    run, made = scored_run(alice, make_run)
    rescore = rescoring.start_rescore(alice, run, make_reward(alice, name="lenient", source=LENIENT))
    Rescore.objects.filter(pk=rescore.pk).update(status="running")  # both deliveries claimed it
    late = [RescoredRollout(rescore=rescore, rollout=made[0], old_reward=1.0, new_reward=9.0)]
    assert rescoring.run_rescore(rescore.pk) == "succeeded"  # the first to finish
    assert rescoring._finish(rescore.pk, "succeeded", results=late, done=1) == "succeeded"  # the second
    assert RescoredRollout.objects.filter(rescore=rescore).count() == 7
    assert RescoredRollout.objects.get(rescore=rescore, rollout=made[0]).new_reward == 1.0
    assert Rescore.objects.get(pk=rescore.pk).done == 7


def test_the_job_is_claimed_once(alice, make_run, make_reward):
    run, _ = scored_run(alice, make_run)
    rescore = rescoring.start_rescore(alice, run, make_reward(alice, name="lenient", source=LENIENT))
    assert rescoring.run_rescore(rescore.pk) == "succeeded"
    with CaptureQueriesContext(connection) as queries:
        assert rescoring.run_rescore(rescore.pk) == "succeeded"  # a redelivered message scores nothing again
    assert len(queries) <= 4
    assert RescoredRollout.objects.filter(rescore=rescore).count() == 7


def test_the_pages_start_it_and_show_old_and_new_side_by_side(alice, client, make_run, make_reward):
    run, made = scored_run(alice, make_run)
    script = make_reward(alice, name="lenient", source=LENIENT)
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/")
    assert page.status_code == 200 and b'id="rescore-form"' in page.content and b"lenient (v1)" in page.content
    response = client.post(f"/runs/{run.pk}/rescores/", {"reward_script": script.pk, "scope": "all"})
    rescore = Rescore.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/rescores/{rescore.pk}/"
    queued = client.get(response["Location"])
    assert b'http-equiv="refresh"' in queued.content and b">queued<" in queued.content
    rescoring.run_rescore(rescore.pk)
    done = client.get(response["Location"]).content.decode()
    assert "<strong>3</strong> of 7 rewards changed" in done
    assert f'<tr data-rollout="{made[1].pk}" class="changed">' in done
    assert '<tr data-split="val"><td>val</td><td class="num">2</td><td class="num">0.500</td><td class="num">0.750</td>' in done
    assert 'http-equiv="refresh"' not in done
    changed = client.get(response["Location"] + "?changed=1").content.decode()
    assert f'data-rollout="{made[0].pk}"' not in changed and f'data-rollout="{made[5].pk}"' in changed


def test_the_page_form_refuses_with_the_reason(alice, client, make_run, make_reward):
    run, _ = scored_run(alice, make_run)
    script = make_reward(alice, name="lenient", source=LENIENT)
    client.force_login(alice)
    response = client.post(f"/runs/{run.pk}/rescores/", {"reward_script": script.pk, "scope": "step", "step": "9"},
                           follow=True)
    assert response.status_code == 200
    assert "Not re-scored: run" in response.content.decode() and "no scored rollouts step 9" in response.content.decode()
    assert not Rescore.objects.exists()


def test_the_page_form_refuses_a_step_past_the_column(alice, client, make_run, make_reward):
    run, _ = scored_run(alice, make_run)
    script = make_reward(alice, name="lenient", source=LENIENT)
    client.force_login(alice)
    response = client.post(f"/runs/{run.pk}/rescores/", {"reward_script": script.pk, "scope": "step",
                                                          "step": str(2**40)}, follow=True)
    assert response.status_code == 200
    assert f"step must be between 0 and {2**31 - 1}, got {2**40}" in response.content.decode()
    assert not Rescore.objects.exists()


def test_an_outcome_is_kept_up_to_its_limit_and_a_bare_value_round_trips(alice, make_run, make_reward):
    assert rollout_services.stored_outcome({"a": "x\x00y"}) == {"a": "x\ufffdy"}
    big = {"files": {"a.py": "x" * rollout_services.OUTCOME_LIMIT_BYTES}}
    assert rollout_services.stored_outcome(big) == {
        "_not_stored": f"{rollout_services.OUTCOME_LIMIT_BYTES + 23} bytes, over the 1000000 kept"}
    run, made = scored_run(alice, make_run)
    Rollout.objects.filter(pk=made[0].pk).update(outcome=rollout_services.stored_outcome([1, 2]))
    script = make_reward(alice, name="length", source="def reward(task, outcome):\n    return float(len(outcome))\n")
    rescore = rescoring.start_rescore(alice, run, script)
    rescoring.run_rescore(rescore.pk)
    assert RescoredRollout.objects.get(rescore=rescore, rollout=made[0]).new_reward == 2.0  # the list, unwrapped
