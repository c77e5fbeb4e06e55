"""runs.signal: the learning signal step by step (groups sampled, with signal, trained, dropped by dynamic sampling),
the run page's notice when groups lose it, the API's figures, and the step page's dropped groups."""
from __future__ import annotations

import json

import pytest
from django.urls import reverse

from runs import rollout_services, services, signal
from tests.dashboard.test_rollouts_table import make_rollout

pytestmark = pytest.mark.django_db


def running(make_run, owner, config=None):
    run = make_run(owner, config={"steps": 10, **(config or {})})
    services.claim_run(run.pk, "task")
    return services.transition_run(run.pk, "running")


def dynamic_step(sampled, trained, trained_with_signal, dropped, group_size=4):
    """The groups/* metrics trainer.scheduler records for one step."""
    with_signal = trained_with_signal
    return {"groups/total": float(sampled), "groups/with_signal": float(with_signal),
            "groups/sampled": float(sampled), "groups/trained": float(trained),
            "groups/trained_with_signal": float(trained_with_signal), "groups/dropped_no_signal": float(dropped),
            "groups/signal_share": trained_with_signal / trained, "groups/sampled_signal_share": with_signal / sampled,
            "rollout/extra": float(dropped * group_size), "reward/mean": 0.5}


def test_step_figures_read_dynamic_sampling_and_older_runs_alike(alice, make_run):
    run = running(make_run, alice, {"dynamic_sampling": True})
    services.record_metrics(run.pk, 0, {"eval/pass@1": 0.1})  # an evaluation: not a step of groups
    services.record_metrics(run.pk, 1, dynamic_step(sampled=6, trained=4, trained_with_signal=4, dropped=2))
    services.record_metrics(run.pk, 2, {"groups/total": 8.0, "groups/with_signal": 2.0})  # recorded before groups/*
    rows = signal.step_figures(run)
    assert rows == [
        {"step": 1, "groups_sampled": 6, "groups_with_signal": 4, "groups_trained": 4, "groups_trained_with_signal": 4,
         "groups_dropped_no_signal": 2, "extra_rollouts": 8, "signal_share": 1.0,
         "sampled_signal_share": pytest.approx(4 / 6)},
        {"step": 2, "groups_sampled": 8, "groups_with_signal": 2, "groups_trained": 8, "groups_trained_with_signal": 2,
         "groups_dropped_no_signal": 0, "extra_rollouts": 0, "signal_share": 0.25, "sampled_signal_share": 0.25},
    ]


@pytest.mark.parametrize("shares, dynamic, expected", [
    ([0.75, 0.5], False, None),  # mean 0.625: fine
    ([0.25], False, None),  # one step is not a trend
    ([0.9, 0.5, 0.25], False, "in steps 2-3, 38% of the groups sampled"),
    ([0.25, 0.25], True, "Dynamic sampling dropped 2 groups without signal in these steps."),
])
def test_the_notice_shows_when_the_last_two_steps_mostly_lack_signal(shares, dynamic, expected):
    rows = [{"step": i + 1, "sampled_signal_share": s, "groups_dropped_no_signal": 1} for i, s in enumerate(shares)]
    found = signal.notice(rows, dynamic)
    if expected is None:
        assert found is None
    else:
        assert expected in found["text"] and found["steps"] == [len(shares) - 1, len(shares)]
        assert found["share"] == pytest.approx(sum(shares[-2:]) / 2)
        assert ("Clone the run with dynamic_sampling on" in found["text"]) == (not dynamic)


def test_the_run_page_warns_before_the_curve_goes_flat_and_hands_the_script_its_inputs(client, alice, make_run):
    run = running(make_run, alice)
    client.force_login(alice)
    services.record_metrics(run.pk, 1, {"groups/total": 8.0, "groups/with_signal": 6.0, "time/step": 3.0})
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert '<p id="run-signal" class="signal-notice" hidden></p>' in html
    services.record_metrics(run.pk, 2, {"groups/total": 8.0, "groups/with_signal": 2.0, "time/step": 3.0})
    services.record_metrics(run.pk, 3, {"groups/total": 8.0, "groups/with_signal": 1.0, "time/step": 3.0})
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert ('<p id="run-signal" class="signal-notice">Groups are losing their learning signal: in steps 2-3, 19% of '
            'the groups sampled had attempts that scored differently.') in html
    assert "Clone the run with dynamic_sampling on, or raise temperature or group_size." in html
    config = json.loads(html.split('<script id="run-page-config" type="application/json">')[1].split("</script>")[0])
    assert config["signal"] == {"dynamic_sampling": False, "low_share": 0.5, "window": 2,
                                "steps": [{"step": 2, "share": 0.25, "dropped": 0},
                                          {"step": 3, "share": 0.125, "dropped": 0}]}


def test_the_api_returns_the_signal_figures_to_the_owner_only(alice_api, bob_api, alice, make_run):
    run = running(make_run, alice, {"dynamic_sampling": True})
    services.record_metrics(run.pk, 1, dynamic_step(sampled=8, trained=4, trained_with_signal=2, dropped=4))
    services.record_metrics(run.pk, 2, dynamic_step(sampled=8, trained=4, trained_with_signal=3, dropped=4))
    response = alice_api.get(f"/api/v1/runs/{run.pk}/signal/")
    assert response.status_code == 200
    body = response.json()
    assert body["dynamic_sampling"] is True and (body["low_share"], body["window"]) == (0.5, 2)
    assert [(r["step"], r["groups_sampled"], r["groups_trained"], r["groups_dropped_no_signal"], r["extra_rollouts"],
             r["signal_share"]) for r in body["steps"]] == [(1, 8, 4, 4, 16, 0.5), (2, 8, 4, 4, 16, 0.75)]
    assert body["notice"]["steps"] == [1, 2] and body["notice"]["share"] == pytest.approx(5 / 16)
    assert "Dynamic sampling dropped 8 groups without signal" in body["notice"]["text"]
    assert bob_api.get(f"/api/v1/runs/{run.pk}/signal/").status_code == 404


def test_the_step_page_marks_a_group_dynamic_sampling_dropped(client, alice, make_run):
    run = running(make_run, alice, {"dynamic_sampling": True})
    client.force_login(alice)
    kept = [make_rollout(run, group=0, attempt=a, reward=float(a)) for a in (0, 1)]
    dropped = [make_rollout(run, group=1, attempt=a, reward=1.0) for a in (0, 1)]
    rollout_services.record_step(run.pk, 1, 1, [], {}, {"reward/mean": 0.75},
                                 {**{r.pk: "" for r in kept},
                                  **{r.pk: "no_signal: every attempt scored 1" for r in dropped}})
    html = client.get(reverse("run-step", args=[run.pk, 1])).content.decode()
    assert "2 groups\n    sampled (1 dropped without signal by dynamic sampling)" in html
    head = html.split('data-group="1"')[1].split("</th>")[0]
    assert "no signal, not trained" in head
    assert "no signal, not trained" not in html.split('data-group="1"')[0]
    for r in dropped:
        assert f'<li class="dropped" data-rollout="{r.pk}" data-reason="no_signal">' in html
    assert html.count("no_signal: every attempt scored 1") == 2
