"""Alarms in the API, on the run page (the panel, acknowledging) and in the runs list (the badge)."""
import pytest

from health import services as health_services
from health.models import RunAlarm
from runs.models import RunEvent
from tests.health.steps import Attempt, clean_attempts, store_step

pytestmark = pytest.mark.django_db


def collapsed_run(alice, make_run, name="run"):
    run = make_run(alice, name=name)
    rollouts = store_step(run, 1, [[Attempt(reward=1.0) for _ in range(4)] for _ in range(4)])
    health_services.check_step(run.pk, 1)
    return run, rollouts


def test_the_api_lists_alarms_and_acknowledges_one_once(alice, alice_api, make_run):
    run, rollouts = collapsed_run(alice, make_run)
    body = alice_api.get(f"/api/v1/runs/{run.pk}/alarms/").json()
    assert [(a["step"], a["kind"], a["severity"]) for a in body] == [(1, "no_signal", "warning"),
                                                                    (1, "reward_collapse", "critical")]
    collapse = body[1]
    assert collapse["label"] == "Reward collapse" and collapse["rollout_ids"] == [r.pk for r in rollouts[:5]]
    assert collapse["evidence"] == {"reward": 1.0, "rollouts": 16} and collapse["acknowledged_at"] is None
    assert alice_api.get(f"/api/v1/runs/{run.pk}/").json()["open_alarms"] == 2
    assert [r["open_alarms"] for r in alice_api.get("/api/v1/runs/").json()["results"]] == [2]

    response = alice_api.post(f"/api/v1/runs/{run.pk}/alarms/{collapse['id']}/acknowledge/")
    assert response.status_code == 200
    assert response.json()["acknowledged_by"] == "alice" and response.json()["acknowledged_at"]
    assert RunAlarm.objects.get(pk=collapse["id"]).acknowledged_by == alice
    assert RunEvent.objects.filter(run=run, kind="run.alarm").last().payload["acknowledged"] is True
    again = alice_api.post(f"/api/v1/runs/{run.pk}/alarms/{collapse['id']}/acknowledge/")
    assert again.status_code == 409 and "was acknowledged" in again.json()["error"]["message"]
    assert [a["kind"] for a in alice_api.get(f"/api/v1/runs/{run.pk}/alarms/?open=1").json()] == ["no_signal"]
    assert alice_api.get(f"/api/v1/runs/{run.pk}/").json()["open_alarms"] == 1


def test_another_users_alarms_are_not_found(alice, bob_api, make_run):
    run, _ = collapsed_run(alice, make_run)
    alarm = RunAlarm.objects.filter(run=run).first()
    assert bob_api.get(f"/api/v1/runs/{run.pk}/alarms/").status_code == 404
    assert bob_api.post(f"/api/v1/runs/{run.pk}/alarms/{alarm.pk}/acknowledge/").status_code == 404
    assert RunAlarm.objects.get(pk=alarm.pk).acknowledged_at is None


def test_the_run_page_panel_lists_each_alarm_with_its_evidence_and_examples(alice, client, make_run):
    run, rollouts = collapsed_run(alice, make_run)
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert '<span class="alarm-total alarm-open" id="health-open">2 open alarms</span>' in page
    assert "Step 1 · Reward collapse" in page and "reward=1 · rollouts=16" in page
    assert f'<a href="/rollouts/{rollouts[0].pk}/">#{rollouts[0].pk}</a>' in page
    alarm = RunAlarm.objects.get(run=run, kind="reward_collapse")
    response = client.post(f"/runs/{run.pk}/alarms/{alarm.pk}/acknowledge/")
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/#health"
    panel = client.get(f"/runs/{run.pk}/health/").content.decode()
    assert "1 open alarm<" in panel and "acknowledged by alice" in panel
    assert f'data-alarm="{alarm.pk}" data-kind="reward_collapse"' in panel


def test_a_clean_run_page_says_no_alarms(alice, client, make_run):
    run = make_run(alice)
    store_step(run, 1, clean_attempts())
    health_services.check_step(run.pk, 1)
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="no-alarms"' in page and "0 open alarms" in page


def test_the_runs_list_shows_the_open_alarms_badge(alice, client, make_run):
    noisy, _ = collapsed_run(alice, make_run, name="noisy")
    quiet = make_run(alice, name="quiet")
    client.force_login(alice)
    rows = {row["id"]: row["alarms"] for row in client.get("/runs/rows/").json()["rows"]}
    assert rows == {noisy.pk: 2, quiet.pk: 0}
    page = client.get("/").content.decode()
    assert f'href="/runs/{noisy.pk}/#health" title="health alarms not acknowledged">⚠ <span class="alarm-count">2</span>' in page
    assert f'href="/runs/{quiet.pk}/#health" title="health alarms not acknowledged" hidden>' in page


def test_health_thresholds_are_checked_when_a_run_is_created(alice_api, alice, make_harness, make_dataset,
                                                             make_reward):
    ids = {"harness": make_harness(alice).pk, "dataset": make_dataset(alice).pk, "reward_script": make_reward(alice).pk}
    for health, message in [({"no_signal": 0.5}, "unknown threshold(s) ['no_signal']"),
                            ({"no_signal_share": -1}, "health.no_signal_share must be a number >= 0")]:
        response = alice_api.post("/api/v1/runs/", {"name": "r", "model": "tiny", **ids,
                                                    "config": {"health": health}}, format="json")
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    ok = alice_api.post("/api/v1/runs/", {"name": "r", "model": "tiny", **ids,
                                          "config": {"health": {"no_signal_share": 0.9}}}, format="json")
    assert ok.status_code == 201 and ok.json()["config"]["health"] == {"no_signal_share": 0.9}


def test_ids_no_row_can_have_are_404s_and_a_step_past_the_column_is_a_field_error(alice, alice_api, make_run,
                                                                                  make_reward):
    run, _ = collapsed_run(alice, make_run)
    huge = 2**64
    assert alice_api.get(f"/api/v1/runs/{huge}/alarms/").status_code == 404
    assert alice_api.post(f"/api/v1/runs/{run.pk}/alarms/{huge}/acknowledge/").status_code == 404
    assert alice_api.get(f"/api/v1/runs/{run.pk}/rescores/{huge}/").status_code == 404
    script = make_reward(alice, name="other")
    response = alice_api.post(f"/api/v1/runs/{run.pk}/rescores/", {"reward_script": script.pk, "scope": "step",
                                                                    "step": 2**40}, format="json")
    assert response.status_code == 400 and "step" in response.json()["error"]["fields"]
