"""The run page: header (step, policy version, elapsed, ETA), cancel, the metric series its charts load."""
import json
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from dashboard.pages.run_page import duration_text
from runs import services
from runs.models import Run

pytestmark = pytest.mark.django_db


def page_config(html: str) -> dict:
    found = re.search(r'<script id="run-page-config" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def running(make_run, owner, name="run", steps=10):
    run = make_run(owner, name=name, config={"steps": steps})
    services.claim_run(run.pk, "task")
    return services.transition_run(run.pk, "running")


def test_it_shows_step_policy_version_elapsed_and_eta_from_the_median_step_time(client, alice, make_run):
    run = running(make_run, alice)
    Run.objects.filter(pk=run.pk).update(step=4, policy_version=4,
                                         started_at=timezone.now() - timedelta(minutes=3, seconds=5))
    for step, seconds in ((1, 30.0), (2, 10.0), (3, 12.0), (4, 500.0)):  # median 21 s; one slow step
        services.record_metrics(run.pk, step, {"time/step": seconds, "reward/mean": 0.1 * step})
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    assert '<span id="run-step">4</span> / <span id="run-steps">10</span>' in html
    assert '<dd id="run-policy-version">4</dd>' in html
    assert re.search(r'<dd id="run-elapsed">3m 0[56]s</dd>', html)
    assert '>2m 06s</dd>' in html  # ETA: median 21 s x 6 steps left = 126 s
    assert '<progress id="run-step-progress" class="run-step-progress" max="10" value="4">' in html
    config = page_config(html)
    assert config["run"] == run.pk and config["steps"] == 10 and config["step"] == 4
    assert config["status"] == "running" and config["last_seq"] == Run.objects.get(pk=run.pk).event_seq


def test_a_queued_run_has_no_eta_and_no_elapsed_time(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert '<dd id="run-elapsed">–</dd>' in html
    assert 'id="run-eta" title="median step time × steps left">–</dd>' in html


def test_duration_text():
    assert [duration_text(s) for s in (None, 0, 42.4, 185, 7620)] == ["–", "0s", "42s", "3m 05s", "2h 07m"]


def test_the_page_loads_plotly_and_its_modules_from_this_server(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert '<script src="/static/plotly/plotly.min.js"></script>' in html
    assert '<script type="module" src="/static/js/pages/run_detail.js"></script>' in html
    assert "cdn" not in html.lower() and "https://" not in html
    for panel in ('id="run-chart"', 'id="chart-policy"', 'id="chart-data"', 'id="chart-signal"', 'id="chart-system"'):
        assert panel in html
    assert 'id="chart-smoothing"' in html and 'name="chart-x" value="time"' in html
    assert 'data-url="/runs/%d/rollouts/"' % run.pk in html


def test_the_run_name_is_escaped_in_the_page_config(client, alice, make_run):
    run = make_run(alice, name="</script><script>alert(1)</script>")
    client.force_login(alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert "</script><script>alert(1)" not in html
    assert page_config(html)["name"] == "</script><script>alert(1)</script>"


def test_cancel_ends_a_queued_run(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)
    assert 'id="cancel-form"' in client.get(f"/runs/{run.pk}/").content.decode()
    response = client.post(f"/runs/{run.pk}/cancel/")
    assert response.status_code == 302 and response.url == f"/runs/{run.pk}/"
    assert Run.objects.get(pk=run.pk).status == "cancelled"
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="cancel-form" hidden' in html


def test_cancel_asks_a_running_run_to_stop(client, alice, make_run):
    run = running(make_run, alice)
    client.force_login(alice)
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 302
    assert Run.objects.get(pk=run.pk).status == "cancelling"


def test_cancel_of_a_finished_run_says_why_it_is_refused(client, alice, make_run):
    run = make_run(alice)
    services.fail_run(run.pk, "boom")
    client.force_login(alice)
    response = client.post(f"/runs/{run.pk}/cancel/")
    assert response.status_code == 409
    assert "only queued, starting or running runs can be cancelled" in response.content.decode()
    assert Run.objects.get(pk=run.pk).status == "failed"


def test_finish_after_this_step_lowers_the_steps_of_a_running_run(client, alice, bob, make_run):
    run = make_run(alice, config={"steps": 30})
    client.force_login(alice)
    assert 'id="finish-form" hidden' in client.get(f"/runs/{run.pk}/").content.decode()  # queued: not yet
    services.transition_run(run.pk, "starting")
    services.transition_run(run.pk, "running")
    Run.objects.filter(pk=run.pk).update(step=3)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    form = html[html.index('id="finish-form"'):]
    assert not form.startswith('id="finish-form" hidden') and "Finish after this step" in form[:form.index("</form>")]
    other = Client()
    other.force_login(bob)
    assert other.post(f"/runs/{run.pk}/finish/").status_code == 404
    assert client.get(f"/runs/{run.pk}/finish/").status_code == 405

    response = client.post(f"/runs/{run.pk}/finish/")
    assert response.status_code == 302 and response.url == f"/runs/{run.pk}/"
    run.refresh_from_db()
    assert run.status == "running" and run.config["steps"] == 4
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="finish-form" hidden' in html  # on its last step now
    assert page_config(html)["steps"] == 4 and '<span id="run-steps">4</span>' in html

    services.transition_run(run.pk, "succeeded")
    response = client.post(f"/runs/{run.pk}/finish/")
    assert response.status_code == 409 and "only starting or running runs can be finished early" in \
        response.content.decode()


def test_cancel_needs_post_csrf_and_ownership(alice, bob, make_run):
    run = make_run(bob)
    client = Client(enforce_csrf_checks=True)
    client.force_login(bob)
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 403  # no CSRF token
    assert client.get(f"/runs/{run.pk}/cancel/").status_code == 405
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/")
    assert page.status_code == 404
    client = Client()
    client.force_login(alice)
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 404
    assert Run.objects.get(pk=run.pk).status == "queued"


def test_the_cancel_form_carries_a_csrf_token(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    form = html[html.index('id="cancel-form"'):]
    assert 'name="csrfmiddlewaretoken"' in form[:form.index("</form>")]


def test_the_metric_series_come_in_one_request_by_name(client, alice, make_run, django_assert_max_num_queries):
    run = make_run(alice)
    services.record_metrics(run.pk, 0, {"eval/pass@1": 0.25})
    for step in (1, 2, 3):
        services.record_metrics(run.pk, step, {"reward/mean": step / 10, "reward/std": 0.05, "loss/total": 1.0})
    client.force_login(alice)
    with django_assert_max_num_queries(4):  # session, user, run, metrics
        response = client.get(f"/runs/{run.pk}/series/?name=reward/mean,eval/pass@1&name=reward/std")
    assert response.status_code == 200
    metrics = response.json()["metrics"]
    assert set(metrics) == {"reward/mean", "eval/pass@1", "reward/std"}
    assert metrics["reward/mean"]["step"] == [1, 2, 3]
    assert metrics["reward/mean"]["value"] == pytest.approx([0.1, 0.2, 0.3])
    assert metrics["eval/pass@1"] == {"step": [0], "value": [0.25], "t": metrics["eval/pass@1"]["t"]}
    assert metrics["eval/pass@1"]["t"][0].startswith(str(timezone.now().year))


def test_the_metric_series_of_another_users_run_are_not_found(client, alice, bob, make_run):
    run = make_run(bob)
    services.record_metrics(run.pk, 1, {"reward/mean": 0.5})
    client.force_login(alice)
    assert client.get(f"/runs/{run.pk}/series/").status_code == 404


def test_staff_see_any_run_page(client, staff, bob, make_run):
    run = make_run(bob, name="bobs")
    client.force_login(staff)
    assert client.get(f"/runs/{run.pk}/").status_code == 200
    assert client.get(f"/runs/{run.pk}/rollouts/").status_code == 200


def test_the_eta_uses_the_recent_steps(client, alice, make_run):
    run = running(make_run, alice, steps=100)
    for step in range(1, 31):  # 10 slow steps, then 20 at 2 s
        services.record_metrics(run.pk, step, {"time/step": 50.0 if step <= 10 else 2.0})
    Run.objects.filter(pk=run.pk).update(step=30)
    client.force_login(alice)
    assert ">2m 20s</dd>" in client.get(f"/runs/{run.pk}/").content.decode()  # 2 s x 70 steps


def test_the_page_takes_the_same_queries_however_big_the_run(client, alice, make_run):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.dashboard.test_rollouts_table import make_rollout

    run = running(make_run, alice)
    client.force_login(alice)

    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert client.get(f"/runs/{run.pk}/").status_code == 200
        return [q["sql"] for q in captured.captured_queries]

    make_rollout(run, step=1, reward=1.0, calls=1)
    services.record_metrics(run.pk, 1, {"time/step": 3.0, "reward/mean": 1.0})
    small = queries()
    for step in range(2, 30):
        make_rollout(run, step=step, reward=0.5, calls=2)
        services.record_metrics(run.pk, step, {"time/step": 3.0, "reward/mean": 1.0})
    big = queries()
    assert len(small) == len(big) <= 8  # 5, and the health panel's alarms, reward scripts and re-scorings
    assert not any("modelcall" in sql.lower() or "runs_rollout" in sql.lower() for sql in big)


def test_the_header_says_what_the_run_is_doing(client, alice, make_run):
    run = running(make_run, alice)
    client.force_login(alice)
    services.set_run_phase(run.pk, "starting the engine: ready", 1.0)
    assert '<span id="run-phase">starting the engine: ready</span>' in client.get(f"/runs/{run.pk}/").content.decode()
    services.record_metrics(run.pk, 1, {"reward/mean": 0.5})
    Run.objects.filter(pk=run.pk).update(step=1)
    services.set_run_phase(run.pk, "step 2: generating rollouts")  # the scheduler's own phase, not a guess
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert '<span id="run-phase">step 2: generating rollouts</span>' in html
    services.set_run_phase(run.pk, "evaluating step 1: 3/8", 0.375)
    assert '<span id="run-phase">evaluating step 1: 3/8</span>' in client.get(f"/runs/{run.pk}/").content.decode()
    services.fail_run(run.pk, "boom")
    assert '<span id="run-phase"></span>' in client.get(f"/runs/{run.pk}/").content.decode()


def test_the_header_shows_the_workers_host_and_the_formats_it_chose(client, alice, make_run):
    from django.utils.html import escape

    from runs.orchestrator import record_host
    from trainer.config import TrainerConfig
    from trainer.host import detect, resolve

    run = make_run(alice, config={"engine_dtype": "float32"})  # the trainer's dtype stays auto
    client.force_login(alice)
    assert '<dd id="run-host">not started yet</dd>' in client.get(f"/runs/{run.pk}/").content.decode()
    config, line = record_host(run.pk, TrainerConfig.from_dict(run.config))  # what a worker does at run start
    here = detect()
    best = "bfloat16" if here.native_bf16 else "float32"
    assert (config.engine_dtype, config.dtype) == ("float32", best) == (resolve(here, "float32").engine_dtype, best)
    assert line == (f"{here.describe()} -> engine float32, trainer {best} "
                    f"(auto (trainer): the CPU has {'native' if here.native_bf16 else 'no native'} bf16)")
    stored = Run.objects.get(pk=run.pk)
    assert stored.config["dtype"] == "auto" and stored.config["engine_dtype"] == "float32"  # settings unchanged
    assert stored.host["summary"] == line and stored.host["torch_capability"] == here.torch_capability
    assert stored.host["formats"] == {"engine_dtype": "float32", "trainer_dtype": best,
                                      "reason": "auto (trainer): the CPU has " + (
                                          "native bf16" if here.native_bf16 else "no native bf16")}
    assert f'<dd id="run-host">{escape(line)}</dd>' in client.get(f"/runs/{run.pk}/").content.decode()
    api = client.get(f"/api/v1/runs/{run.pk}/")
    assert api.status_code == 200 and api.json()["host"] == stored.host
