"""The runs list (/): latest metrics, progress and sparklines per run; filters, sort and pages in SQL; its JSON rows
(/runs/rows/); bulk cancel (/runs/cancel/); a constant number of queries however many runs."""
import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from dashboard import run_summaries
from runs import rollout_services, services
from runs.models import Metric, Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def kit(alice, make_harness, make_dataset, make_reward):
    """One harness, dataset and reward script of alice's, shared by many runs."""
    return {"harness": make_harness(alice, name="agent-h"), "dataset": make_dataset(alice, name="math-d"),
            "reward_script": make_reward(alice, name="exact-r")}


def new_run(owner, kit, name, steps=10, **kw):
    return services.create_run(owner, name=name, model="tiny", config={"steps": steps, **kw}, **kit)


def train(run, step, reward, **more):
    rollout_services.record_step(run.pk, step, step, samples=[], drift={}, metrics={"reward/mean": reward, **more})


def start(run):
    services.transition_run(run.pk, "starting")
    services.transition_run(run.pk, "running")


def rows(client, query=""):
    response = client.get(f"/runs/rows/{query}")
    assert response.status_code == 200
    return response.json()


def test_a_row_shows_status_progress_elapsed_latest_metrics_and_a_sparkline(client, alice, kit):
    run = new_run(alice, kit, "trained", steps=10)
    start(run)
    for step, reward in ((1, 0.1), (2, 0.3), (3, 0.5)):
        train(run, step, reward)
    services.record_metrics(run.pk, 3, {"eval/pass@1": 0.25})
    client.force_login(alice)

    page = client.get("/").content.decode()
    assert '<tr data-run="%d">' % run.pk in page
    assert '<span class="status status-running">running</span>' in page
    assert '<progress max="10" value="3"></progress>' in page and '<span class="step">3/10</span>' in page
    assert '<td class="reward num">0.500</td>' in page and '<td class="pass1 num">0.250</td>' in page
    assert '<td class="harness">agent-h</td>' in page and '<td class="dataset">math-d</td>' in page
    assert '<td class="model">tiny</td>' in page
    assert "Start the demo run" not in page

    [row] = rows(client)["rows"]
    assert row["id"] == run.pk and row["status"] == "running" and row["url"] == f"/runs/{run.pk}/"
    assert (row["step"], row["steps"], row["progress"]) == (3, 10, pytest.approx(0.3))
    assert row["reward"] == pytest.approx(0.5) and row["pass1"] == pytest.approx(0.25)
    assert row["spark"] == [[1, pytest.approx(0.1)], [2, pytest.approx(0.3)], [3, pytest.approx(0.5)]]
    assert row["ticking"] is True and 0 <= row["elapsed_s"] < 60
    assert row["event_seq"] == Run.objects.get(pk=run.pk).event_seq and row["cancellable"] is True
    assert (row["harness"], row["dataset"], row["model"]) == ("agent-h", "math-d", "tiny")


def test_a_queued_run_has_no_elapsed_time_nor_metrics(client, alice, kit):
    new_run(alice, kit, "waiting", steps=4)
    client.force_login(alice)
    [row] = rows(client)["rows"]
    assert (row["elapsed_s"], row["elapsed"], row["ticking"]) == (None, "—", False)
    assert (row["reward"], row["pass1"], row["spark"], row["step"], row["steps"]) == (None, None, [], 0, 4)
    page = client.get("/").content.decode()
    assert '<td class="reward num">—</td>' in page and '<td class="elapsed">—</td>' in page


def test_a_finished_run_elapsed_time_stops_at_its_end(client, alice, kit):
    run = new_run(alice, kit, "done")
    start(run)
    services.transition_run(run.pk, "succeeded")
    run.refresh_from_db()
    Run.objects.filter(pk=run.pk).update(started_at=run.finished_at - timedelta(seconds=3725))
    run.refresh_from_db()
    client.force_login(alice)
    [row] = rows(client)["rows"]
    expected = (run.finished_at - run.started_at).total_seconds()
    assert row["elapsed_s"] == pytest.approx(expected) and row["elapsed"] == "1h 02m" and not row["ticking"]
    assert row["cancellable"] is False


def test_durations_are_formatted_like_the_js():
    f = run_summaries.format_seconds
    assert [f(None), f(0), f(59.9), f(60), f(185), f(3600), f(7620), f(90000)] == [
        "—", "0s", "59s", "1m 00s", "3m 05s", "1h 00m", "2h 07m", "1d 01h"]


def test_the_sparkline_keeps_the_last_50_points_per_run(client, alice, kit):
    long, short = new_run(alice, kit, "long"), new_run(alice, kit, "short")
    Metric.objects.bulk_create([Metric(run=long, step=s, name="reward/mean", value=s / 100) for s in range(70)]
                               + [Metric(run=short, step=s, name="reward/mean", value=1 - s / 10) for s in range(3)]
                               + [Metric(run=long, step=s, name="loss/total", value=9.0) for s in range(70)])
    client.force_login(alice)
    by_id = {row["id"]: row for row in rows(client)["rows"]}
    assert [p[0] for p in by_id[long.pk]["spark"]] == list(range(20, 70))
    assert by_id[long.pk]["spark"][-1][1] == pytest.approx(0.69) and by_id[long.pk]["reward"] == pytest.approx(0.69)
    assert by_id[short.pk]["spark"] == [[0, 1.0], [1, pytest.approx(0.9)], [2, pytest.approx(0.8)]]


def test_the_sparkline_reads_only_the_steps_near_the_runs_step(alice, kit):
    run = new_run(alice, kit, "far")
    Metric.objects.bulk_create([Metric(run=run, step=s, name="reward/mean", value=s) for s in range(0, 1001, 2)])
    lines = run_summaries.sparklines({run.pk: 1000})
    assert [p[0] for p in lines[run.pk]] == list(range(902, 1001, 2))
    assert [p[0] for p in run_summaries.sparklines({run.pk: 1000}, points=3)[run.pk]] == [996, 998, 1000]
    assert run_summaries.sparklines({run.pk: 5000})[run.pk] == []  # nothing after step 4800
    assert run_summaries.sparklines({}) == {}


def test_users_see_their_own_runs_and_staff_all(client, alice, bob, staff, kit, make_run):
    new_run(alice, kit, "alice-run")
    make_run(bob, name="bob-run")
    client.force_login(alice)
    assert [r["name"] for r in rows(client)["rows"]] == ["alice-run"]
    assert "bob-run" not in client.get("/").content.decode()
    client.force_login(staff)
    assert {r["name"] for r in rows(client)["rows"]} == {"alice-run", "bob-run"}


def test_the_list_and_its_rows_need_a_login(client):
    for url in ("/", "/runs/rows/"):
        response = client.get(url)
        assert response.status_code == 302 and response.url.startswith("/accounts/login/")
    assert Client().post("/runs/cancel/", {"ids": "1"}).status_code == 302


def test_filters_by_status_harness_dataset_and_text(client, alice, kit, make_harness, make_dataset):
    other = dict(kit, harness=make_harness(alice, name="other-h"), dataset=make_dataset(alice, name="other-d"))
    a = new_run(alice, kit, "alpha")
    b = new_run(alice, other, "beta")
    c = services.create_run(alice, name="gamma", model="tiny", config={}, **kit)
    Run.objects.filter(pk=c.pk).update(model="Qwen/Qwen3-0.6B")  # a registry name the text filter finds
    services.cancel_run(b, alice)
    client.force_login(alice)

    def names(query):
        return sorted(r["name"] for r in rows(client, query)["rows"])

    assert names("?status=cancelled") == ["beta"]
    assert names("?status=queued") == ["alpha", "gamma"]
    assert names(f"?harness={other['harness'].pk}") == ["beta"]
    assert names(f"?dataset={kit['dataset'].pk}") == ["alpha", "gamma"]
    assert names("?q=ALP") == ["alpha"] and names("?q=qwen3") == ["gamma"]
    assert names(f"?status=queued&harness={kit['harness'].pk}&q=a") == ["alpha", "gamma"]
    assert names("?status=nonsense&harness=x&dataset=-1") == ["alpha", "beta", "gamma"]  # ignored, not an error
    page = client.get("/?status=succeeded").content.decode()
    assert "No runs match these filters." in page and "Start the demo run" not in page
    assert '<option value="succeeded" selected>' in page
    assert f'<option value="{a.harness_id}">agent-h</option>' in page  # the harness filter lists alice's harnesses


def test_it_sorts_in_sql_with_missing_metrics_last(client, alice, kit):
    low, high = new_run(alice, kit, "b-low"), new_run(alice, kit, "c-high")
    new_run(alice, kit, "a-none")  # no metrics: sorted last
    for run, reward, pass1 in ((low, 0.1, 0.9), (high, 0.8, 0.2)):
        start(run)
        train(run, 1, reward)
        services.record_metrics(run.pk, 1, {"eval/pass@1": pass1})
    train(high, 2, 0.9)
    services.transition_run(low.pk, "succeeded")
    client.force_login(alice)

    def order(sort):
        return [r["name"] for r in rows(client, f"?sort={sort}")["rows"]]

    assert order("-created") == ["a-none", "c-high", "b-low"] == order("bogus")  # newest first by default
    assert order("created") == ["b-low", "c-high", "a-none"]
    assert order("name") == ["a-none", "b-low", "c-high"] and order("-name") == ["c-high", "b-low", "a-none"]
    assert order("-reward") == ["c-high", "b-low", "a-none"] and order("reward") == ["b-low", "c-high", "a-none"]
    assert order("-pass1") == ["b-low", "c-high", "a-none"]
    assert order("-step") == ["c-high", "b-low", "a-none"]
    assert order("status") == ["a-none", "c-high", "b-low"]  # queued, running, succeeded: the lifecycle's order
    page = client.get("/?sort=-reward").content.decode()
    assert '<a href="?sort=reward" data-sort="reward">Reward</a> ↓' in page  # a second click sorts ascending


def test_it_pages_by_50(client, alice, kit):
    for i in range(53):
        new_run(alice, kit, f"run-{i:02d}")
    client.force_login(alice)
    first, second = rows(client), rows(client, "?page=2")
    assert (first["count"], first["pages"], len(first["rows"]), len(second["rows"])) == (53, 2, 50, 3)
    assert [r["name"] for r in second["rows"]] == ["run-02", "run-01", "run-00"]
    assert rows(client, "?page=99")["page"] == 2
    page = client.get("/?q=run&page=2").content.decode()
    assert "page 2 of 2" in page and 'href="?q=run&amp;page=1"' in page


def test_the_query_count_does_not_grow_with_the_number_of_runs(client, alice, kit):
    def count(url):
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url).status_code == 200
        return len(queries)

    def add_runs(n):
        for i in range(n):
            run = new_run(alice, kit, f"r{Run.objects.count()}")
            Metric.objects.bulk_create([Metric(run=run, step=s, name=name, value=0.5)
                                        for s in range(5) for name in ("reward/mean", "eval/pass@1")])

    client.force_login(alice)
    add_runs(2)
    few = (count("/"), count("/runs/rows/"), count("/?sort=-reward&q=r"))
    add_runs(15)
    assert (count("/"), count("/runs/rows/"), count("/?sort=-reward&q=r")) == few
    assert few[1] <= 6  # session, user, count, runs with their metrics, sparklines


def test_names_are_escaped(client, alice, kit):
    new_run(alice, kit, '<script>alert(1)</script>"><img src=x onerror=alert(2)>')
    client.force_login(alice)
    page = client.get("/").content.decode()
    assert "<script>alert(1)" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in page
    assert rows(client)["rows"][0]["name"] == '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


def test_bulk_cancel_cancels_what_it_can_and_says_why_not_for_the_rest(client, alice, bob, kit, make_run):
    queued, running, done = (new_run(alice, kit, n) for n in ("q1", "r1", "d1"))
    start(running)
    start(done)
    services.transition_run(done.pk, "succeeded")
    foreign = make_run(bob, name="bobs")
    client.force_login(alice)
    response = client.post("/runs/cancel/", {"ids": [queued.pk, running.pk, done.pk, foreign.pk],
                                             "back": "status=queued&x=<b>"}, follow=True)
    assert response.redirect_chain == [("/?status=queued&x=%3Cb%3E", 302)]
    statuses = dict(Run.objects.values_list("pk", "status"))
    assert statuses == {queued.pk: "cancelled", running.pk: "cancelling", done.pk: "succeeded",
                        foreign.pk: "queued"}
    page = response.content.decode()
    assert f"Cancelled 2: #{queued.pk} q1 (cancelled), #{running.pk} r1 (cancelling)" in page
    assert (f"Not cancelled #{done.pk} d1: run {done.pk} is succeeded; only queued, starting or running runs can "
            "be cancelled") in page
    assert f"Not cancelled #{foreign.pk}: no such run of yours" in page


def test_bulk_cancel_takes_comma_separated_ids_and_asks_for_a_selection(client, alice, kit):
    a, b = new_run(alice, kit, "a"), new_run(alice, kit, "b")
    client.force_login(alice)
    client.post("/runs/cancel/", {"ids": f"{a.pk},{b.pk}"})
    assert set(Run.objects.values_list("status", flat=True)) == {"cancelled"}
    page = client.post("/runs/cancel/", {}, follow=True).content.decode()
    assert "Select the runs to cancel first." in page
    assert client.get("/runs/cancel/").status_code == 405


def test_bulk_cancel_needs_the_csrf_token(alice, kit):
    run = new_run(alice, kit, "a")
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    assert strict.post("/runs/cancel/", {"ids": run.pk}).status_code == 403
    assert Run.objects.get(pk=run.pk).status == "queued"
    page = strict.get("/").content.decode()
    assert 'id="bulk"' in page and 'name="csrfmiddlewaretoken"' in page


def test_the_rows_json_of_a_page_parses_as_the_page_shows(client, alice, kit):
    new_run(alice, kit, "x")
    client.force_login(alice)
    body = json.loads(client.get("/runs/rows/?sort=name").content)
    assert set(body) == {"rows", "page", "pages", "count"} and body["page"] == 1
