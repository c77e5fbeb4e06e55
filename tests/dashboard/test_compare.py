"""The comparison page (/runs/compare/?ids=...): 2 to 8 visible runs, overlaid metric series grouped like the run
page, a config diff of only what differs, a summary table, and a constant number of queries."""
import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from catalog import services as catalog_services
from dashboard import run_summaries
from dashboard.pages.compare import metric_groups
from runs import services
from runs.models import Metric, Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def kit(alice, make_harness, make_dataset, make_reward):
    return {"harness": make_harness(alice, name="agent-h"), "dataset": make_dataset(alice, name="math-d"),
            "reward_script": make_reward(alice, name="exact-r")}


def new_run(owner, kit, name, **config):
    return services.create_run(owner, name=name, model="tiny", config={"steps": 4, **config}, **kit)


def decoded(line: dict) -> tuple[list[int], list[float]]:
    """A series as compare.js reads it: the joined numbers split, the pairs sorted by step."""
    pairs = sorted(zip((int(x) for x in line["x"].split(",")), (float(y) for y in line["y"].split(","))))
    return [x for x, _ in pairs], [y for _, y in pairs]


def chart_data(page: str) -> dict:
    match = re.search(r'<script id="compare-data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


@pytest.fixture
def pair(alice, kit):
    a = new_run(alice, kit, "lr-small", learning_rate=1e-6)
    b = new_run(alice, kit, "lr-big", learning_rate=1e-5, steps=6)
    for run, rewards, passes in ((a, (0.1, 0.2, 0.3), (0.4, 0.35)), (b, (0.2, 0.6, 0.5), (0.5, 0.7))):
        for step, reward in enumerate(rewards, start=1):
            services.record_metrics(run.pk, step, {"reward/mean": reward, "loss/total": 1.0 / step,
                                                   "time/step": 10.0 + step})
        services.record_metrics(run.pk, 0, {"eval/pass@1": passes[0]})
        services.record_metrics(run.pk, 3, {"eval/pass@1": passes[1]})
    services.transition_run(a.pk, "starting")
    services.transition_run(a.pk, "running")
    services.transition_run(a.pk, "succeeded")
    a.refresh_from_db()
    Run.objects.filter(pk=a.pk).update(started_at=a.finished_at - timedelta(seconds=185))
    return a, b


def test_it_overlays_each_metric_of_the_runs_grouped_like_the_run_page(client, alice, pair):
    a, b = pair
    client.force_login(alice)
    response = client.get(f"/runs/compare/?ids={a.pk},{b.pk}")
    assert response.status_code == 200
    page = response.content.decode()
    data = chart_data(page)
    assert [(r["id"], r["name"]) for r in data["runs"]] == [(a.pk, "lr-small"), (b.pk, "lr-big")]
    assert decoded(data["series"]["reward/mean"][str(a.pk)]) == ([1, 2, 3], [0.1, 0.2, 0.3])
    assert decoded(data["series"]["reward/mean"][str(b.pk)]) == ([1, 2, 3], [0.2, 0.6, 0.5])
    assert decoded(data["series"]["eval/pass@1"][str(b.pk)]) == ([0, 3], [0.5, 0.7])
    groups = re.findall(r'<section class="compare-group" data-group="(\w+)">', page)
    assert groups == ["Reward", "Policy", "System"]
    charts = re.findall(r'<div class="compare-chart" data-metric="([^"]+)"></div>', page)
    assert charts == ["reward/mean", "eval/pass@1", "loss/total", "time/step"]
    assert "plotly/plotly.min.js" in page and "cdn" not in page.lower()


def test_the_config_diff_shows_only_what_differs(client, alice, pair):
    a, b = pair
    client.force_login(alice)
    page = client.get(f"/runs/compare/?ids={a.pk},{b.pk}").content.decode()
    diff = page[page.index('id="config-diff"'):page.index("</table>", page.index('id="config-diff"'))]
    keys = re.findall(r'<tr data-key="([^"]+)" class="config differs">', diff)
    assert keys == ["learning_rate", "steps"]
    assert "<code>1e-06</code>" in diff and "<code>1e-05</code>" in diff
    assert re.findall(r'<tr data-key="([^"]+)" class="made-of">', diff) == [
        "model", "harness", "dataset", "reward script", "host", "engine dtype (resolved)", "trainer dtype (resolved)"]
    assert "<td>agent-h v1</td>" in diff and "<td>exact-r v1</td>" in diff
    same = page[page.index('id="config-same"'):]
    assert "<code>temperature</code>" in same and "<code>learning_rate</code>" not in same


def test_the_dtypes_each_host_resolved_show_beside_the_auto_settings(client, alice, pair):
    from trainer.host import HostProfile, resolve, summary

    a, b = pair
    for run, host in ((a, HostProfile(cpu_flags=("avx2", "avx512f", "avx512_bf16"), torch_capability="AVX512",
                                      cores=2, memory_gb=23.5)),
                      (b, HostProfile(cpu_flags=("avx2",), torch_capability="AVX2", cores=2, memory_gb=23.5))):
        formats = resolve(host)  # what orchestrator.record_host writes when a worker starts the run
        Run.objects.filter(pk=run.pk).update(host={**host.to_dict(), "formats": formats.to_dict(),
                                                   "summary": summary(host, formats)})
    client.force_login(alice)
    page = client.get(f"/runs/compare/?ids={a.pk},{b.pk}").content.decode()
    assert '<tr data-key="engine dtype (resolved)" class="made-of differs">' in page
    assert '<td class="differs">bfloat16</td><td class="differs">float32</td>' in page
    assert ('<td class="differs">CPU: AVX-512, native bf16 (2 cores, 23.5 GiB) -&gt; engine bfloat16, trainer bfloat16'
            '</td><td class="differs">CPU: AVX2, no native bf16 (2 cores, 23.5 GiB) -&gt; engine float32, trainer '
            'float32</td>') in page
    same = page[page.index('id="config-same"'):]
    assert "<code>dtype</code>" in same and "<code>engine_dtype</code>" in same  # both asked for auto


def test_a_changed_harness_version_shows_in_the_diff(client, alice, kit):
    a = new_run(alice, kit, "before")
    catalog_services.update_harness(kit["harness"], command=["python", "agent2.py"])
    b = new_run(alice, kit, "after")
    client.force_login(alice)
    page = client.get(f"/runs/compare/?ids={a.pk},{b.pk}").content.decode()
    assert '<tr data-key="harness" class="made-of differs">' in page
    assert '<td class="differs">agent-h v1</td><td class="differs">agent-h v2</td>' in page
    assert 'id="config-all-same"' in page


def test_the_summary_gives_final_reward_best_and_last_pass1_steps_and_wall_time(client, alice, pair):
    a, b = pair
    client.force_login(alice)
    page = client.get(f"/runs/compare/?ids={b.pk},{a.pk}").content.decode()
    table = page[page.index('id="compare-summary"'):page.index("</table>", page.index('id="compare-summary"'))]
    rows = re.findall(r'<tr data-run="(\d+)">(.*?)</tr>', table, re.S)
    assert [int(pk) for pk, _ in rows] == [b.pk, a.pk]  # the order asked for
    cells = {int(pk): re.findall(r'<td class="num (\S+)">([^<]*)</td>', body) for pk, body in rows}
    assert cells[a.pk] == [("final-reward", "0.300"), ("best-pass1", "0.400"), ("last-pass1", "0.350"),
                           ("steps", "0/4"), ("wall", "3m 05s")]
    assert cells[b.pk] == [("final-reward", "0.500"), ("best-pass1", "0.700"), ("last-pass1", "0.700"),
                           ("steps", "0/6"), ("wall", "—")]


@pytest.mark.parametrize("query", ["", "?ids=", "?ids=1", "?ids=1,2,3,4,5,6,7,8,9", "?ids=1,x", "?ids=1,1"])
def test_fewer_than_2_or_more_than_8_runs_or_bad_ids_are_a_clear_400(client, alice, query):
    client.force_login(alice)
    response = client.get(f"/runs/compare/{query}")
    assert response.status_code == 400
    page = response.content.decode()
    assert 'id="compare-error"' in page
    assert "compare 2 to 8 runs at a time" in page or "is not a run id" in page


def test_ids_may_be_repeated_parameters(client, alice, pair):
    a, b = pair
    client.force_login(alice)
    assert client.get(f"/runs/compare/?ids={a.pk}&ids={b.pk}").status_code == 200


def test_another_users_run_is_not_found_and_staff_may_compare_any(client, alice, bob, staff, pair, make_run):
    a, _ = pair
    foreign = make_run(bob, name="bobs")
    client.force_login(alice)
    assert client.get(f"/runs/compare/?ids={a.pk},{foreign.pk}").status_code == 404
    assert client.get(f"/runs/compare/?ids={a.pk},999999").status_code == 404
    client.force_login(staff)
    page = client.get(f"/runs/compare/?ids={a.pk},{foreign.pk}")
    assert page.status_code == 200 and "bobs" in page.content.decode()


def test_it_needs_a_login(client, pair):
    a, b = pair
    response = client.get(f"/runs/compare/?ids={a.pk},{b.pk}")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_names_are_escaped(client, alice, kit):
    a = new_run(alice, kit, "<script>alert(1)</script>")
    b = new_run(alice, kit, '"><img src=x onerror=alert(2)>')
    client.force_login(alice)
    page = client.get(f"/runs/compare/?ids={a.pk},{b.pk}").content.decode()
    assert "<script>alert(1)" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert [r["name"] for r in chart_data(page)["runs"]] == ["<script>alert(1)</script>",
                                                             '"><img src=x onerror=alert(2)>']


def test_the_query_count_does_not_grow_with_runs_or_metrics(client, alice, kit):
    def add(n, steps):
        runs = [new_run(alice, kit, f"r{Run.objects.count()}", learning_rate=1e-6 * (i + 1)) for i in range(n)]
        Metric.objects.bulk_create([Metric(run=run, step=s, name=name, value=0.1)
                                    for run in runs for s in range(steps)
                                    for name in ("reward/mean", "loss/total", "eval/pass@1")])
        return runs

    def count(runs):
        with CaptureQueriesContext(connection) as queries:
            assert client.get(f"/runs/compare/?ids={','.join(str(r.pk) for r in runs)}").status_code == 200
        return len(queries)

    client.force_login(alice)
    few = count(add(2, 3))
    assert count(add(8, 30)) == few


def test_long_runs_are_thinned_in_sql_keeping_evaluations_and_the_last_step(alice, kit):
    long, short = new_run(alice, kit, "long"), new_run(alice, kit, "short")
    Metric.objects.bulk_create([Metric(run=long, step=s, name="reward/mean", value=s) for s in range(2501)]
                               + [Metric(run=long, step=s, name="eval/pass@1", value=0.5) for s in range(0, 2501, 7)]
                               + [Metric(run=short, step=s, name="reward/mean", value=s) for s in range(10)])
    series = run_summaries.metric_series({long.pk: 2500, short.pk: 9, 999999: None}, points=1000)
    steps, values = decoded(series["reward/mean"][long.pk])
    assert steps[:3] == [0, 3, 6] and steps[-2:] == [2499, 2500] and len(steps) == 835
    assert values == [float(s) for s in steps]  # each value with its own step
    assert decoded(series["eval/pass@1"][long.pk])[0] == list(range(0, 2501, 7))  # every evaluation kept
    assert decoded(series["reward/mean"][short.pk]) == (list(range(10)), [float(s) for s in range(10)])


def test_metric_groups_put_reward_and_pass1_first_and_unknown_names_last():
    groups = metric_groups(["zeta/x", "time/step", "eval/tasks", "eval/pass@1", "reward/std", "reward/mean",
                            "actor/grad_norm", "length/completion_tokens_mean", "train/logprob_mismatch_mean"])
    assert [(g["title"], g["metrics"]) for g in groups] == [
        ("Reward", ["reward/mean", "eval/pass@1", "eval/tasks", "reward/std"]),
        ("Policy", ["actor/grad_norm", "train/logprob_mismatch_mean"]),
        ("Data", ["length/completion_tokens_mean"]),
        ("System", ["time/step"]),
        ("Other", ["zeta/x"]),
    ]


def test_runs_without_metrics_say_so(client, alice, kit):
    a, b = new_run(alice, kit, "a"), new_run(alice, kit, "b")
    client.force_login(alice)
    page = client.get(f"/runs/compare/?ids={a.pk},{b.pk}").content.decode()
    assert 'id="no-metrics"' in page and chart_data(page)["series"] == {}
    assert 'class="compare-chart"' not in page


def test_the_comparison_answers_its_series_as_json_for_the_live_backfill(alice, make_run):
    from django.test import Client

    runs = [make_run(alice, name=f"r{i}") for i in range(2)]
    services.record_metrics(runs[0].pk, 1, {"reward/mean": 0.5})
    services.record_metrics(runs[0].pk, 2, {"reward/mean": 0.75})
    client = Client()
    client.force_login(alice)
    response = client.get(f"/runs/compare/?ids={runs[0].pk},{runs[1].pk}&format=json")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    body = response.json()
    assert [r["id"] for r in body["runs"]] == [runs[0].pk, runs[1].pk]
    series = body["series"]["reward/mean"][str(runs[0].pk)]
    assert sorted(zip(map(int, series["x"].split(",")), map(float, series["y"].split(",")))) == [(1, 0.5), (2, 0.75)]
    assert str(runs[1].pk) not in body["series"]["reward/mean"]
