"""The run comparison page: 2 to 8 runs, each metric's chart with the runs overlaid, the settings that differ and a
summary table; the metrics come from SQL in a constant number of queries (dashboard.run_summaries)."""
from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, JsonResponse
from django.shortcuts import render
from django.urls import path
from django.utils import timezone
from django.views.decorators.http import require_GET

from dashboard import run_summaries
from dashboard.run_summaries import PASS1, REWARD, format_seconds, wall_seconds
from runs.models import Run

MIN_RUNS, MAX_RUNS = 2, 8
COLORS = ("#5b3cc4", "#e8590c", "#0b8a5f", "#c2255c", "#1971c2", "#a07b00", "#495057", "#00a3b4")
GROUPS = (  # the run page's panels, by metric name prefix; the first group that matches takes a metric
    ("Reward", ("reward/", "eval/")),
    ("Policy", ("loss/", "actor/", "is/", "mismatch/", "advantage/", "train/logprob_mismatch")),
    ("Data", ("length/", "rollout/", "samples/", "drift/", "proxy/")),
    ("System", ("time/", "train/", "staleness/")),
)
FIRST = (REWARD, PASS1)


@login_required
@require_GET
def compare_runs(request):
    """/runs/compare/?ids=1,2,3 (or ids=1&ids=2): 400 for fewer than 2 or more than 8 runs, 404 if one is not yours."""
    try:
        ids = parse_ids(request.GET.getlist("ids"))
    except ValueError as exc:
        return render(request, "runs/compare.html", {"error": str(exc)}, status=400)
    runs = run_summaries.compared_runs(request.user, ids)
    if len(runs) != len(ids):
        missing = sorted(set(ids) - {run.pk for run in runs})
        raise Http404(f"no run {', '.join(f'#{pk}' for pk in missing)} of yours")
    series = run_summaries.metric_series({run.pk: run.last_metric_step for run in runs})
    colors = {run.pk: COLORS[i] for i, run in enumerate(runs)}
    chart = {"runs": [{"id": run.pk, "name": run.name, "color": colors[run.pk]} for run in runs],
             "series": series}
    if request.GET.get("format") == "json":  # the page's backfill after its live feed (re)connects
        return JsonResponse(chart)
    return render(request, "runs/compare.html", {
        "runs": [{"run": run, "color": colors[run.pk]} for run in runs],
        "groups": metric_groups(series),
        "summary": summary_rows(runs),
        **config_diff(runs),
        "chart": chart,
    })


def parse_ids(values: list[str]) -> list[int]:
    """The run ids of `ids` parameters ("1,2" or repeated), in order without repeats; ValueError says what is wrong."""
    ids: list[int] = []
    for value in values:
        for part in filter(None, (p.strip() for p in value.split(","))):
            if not part.isdigit():
                raise ValueError(f"{part!r} is not a run id: pass ids=1,2,… with the numbers of the runs")
            if int(part) not in ids:
                ids.append(int(part))
    if not MIN_RUNS <= len(ids) <= MAX_RUNS:
        raise ValueError(f"compare {MIN_RUNS} to {MAX_RUNS} runs at a time; {len(ids)} given. "
                         "Select them with the checkboxes of the runs list.")
    return ids


def metric_groups(names) -> list[dict[str, Any]]:
    """[{"title", "metrics"}] in the run page's panel order; reward and eval/pass@1 first, unknown names in Other."""
    grouped: dict[str, list[str]] = {title: [] for title, _ in GROUPS}
    grouped["Other"] = []
    for name in names:
        title = next((title for title, prefixes in GROUPS if name.startswith(prefixes)), "Other")
        grouped[title].append(name)
    order = {name: i for i, name in enumerate(FIRST)}
    return [{"title": title, "metrics": sorted(metrics, key=lambda n: (order.get(n, len(order)), n))}
            for title, metrics in grouped.items() if metrics]


def summary_rows(runs: list[Run]) -> list[dict[str, Any]]:
    now = timezone.now()
    return [{"run": run, "final_reward": run.latest_reward, "best_pass1": run.best_pass1,
             "last_pass1": run.latest_pass1, "steps": run.config.get("steps"),
             "wall": format_seconds(wall_seconds(run.started_at, run.finished_at, now))} for run in runs]


def config_diff(runs: list[Run]) -> dict[str, Any]:
    """What the runs were made of (always shown) and the config keys whose values differ between them."""
    made_of = [
        ("model", [run.model for run in runs]),
        ("harness", [_versioned(run.harness_snapshot) for run in runs]),
        ("dataset", [_versioned(run.dataset_snapshot) for run in runs]),
        ("reward script", [_versioned(run.reward_snapshot) for run in runs]),
        # What `auto` (or a hand setting) became on the worker's host; the config rows below show the settings.
        ("host", [(run.host or {}).get("summary", "not started") for run in runs]),
        ("engine dtype (resolved)", [_formats(run).get("engine_dtype", "—") for run in runs]),
        ("trainer dtype (resolved)", [_formats(run).get("trainer_dtype", "—") for run in runs]),
    ]
    keys = sorted(set().union(*(run.config for run in runs)))
    differ, same = [], []
    for key in keys:
        values = [_shown(run.config, key) for run in runs]
        (differ if len(set(values)) > 1 else same).append((key, values))
    return {"made_of": [{"key": key, "values": values, "differs": len(set(values)) > 1} for key, values in made_of],
            "config_differs": [{"key": key, "values": values} for key, values in differ],
            "config_same": [key for key, _ in same]}


def _formats(run: Run) -> dict:
    return (run.host or {}).get("formats") or {}


def _versioned(snapshot: dict) -> str:
    return f"{snapshot.get('name', '?')} v{snapshot.get('version', '?')}" if snapshot else "—"


def _shown(config: dict, key: str) -> str:
    return json.dumps(config[key], sort_keys=True) if key in config else "(not set)"


urlpatterns = [
    path("runs/compare/", compare_runs, name="run-compare"),
]
