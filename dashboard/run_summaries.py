"""Reads of the runs list and the comparison page: filtered, sorted pages of runs with their latest metrics,
sparklines and overlaid metric series, each in a constant number of queries however many runs there are."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.core.paginator import Page, Paginator
from django.db.models import (
    Aggregate,
    Case,
    F,
    IntegerField,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    TextField,
    Value,
    When,
    Window,
)
from django.db.models.functions import Lower, Mod, RowNumber
from django.utils import timezone
from django.utils.formats import date_format

from catalog import selectors
from health import services as health_services
from runs.models import Metric, Run, RunStatus

REWARD = "reward/mean"
PASS1 = "eval/pass@1"
PAGE_SIZE = 50
SPARK_POINTS = 50
SERIES_POINTS = 1000
"""At most about this many points of one metric of one run on the comparison page (evaluations all kept)."""
ACTIVE = frozenset({RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.CANCELLING})
TICKING = frozenset({RunStatus.STARTING, RunStatus.RUNNING, RunStatus.CANCELLING})
STATUS_RANK = Case(*(When(status=status, then=Value(rank)) for rank, status in enumerate(RunStatus.values)),
                   default=Value(len(RunStatus.values)), output_field=IntegerField())
SORTS = {"created": F("created_at"), "name": Lower("name"), "status": STATUS_RANK, "step": F("step"),
         "reward": F("latest_reward"), "pass1": F("latest_pass1")}
ROW_FIELDS = ("pk", "name", "model", "status", "step", "phase", "event_seq", "created_at", "started_at",
              "finished_at", "config__steps", "harness_snapshot__name", "dataset_snapshot__name", "latest_reward",
              "latest_pass1")


@dataclass(frozen=True)
class RunFilters:
    """The runs list's GET parameters; values that make no sense are dropped rather than refused."""

    status: str = ""
    harness: int | None = None
    dataset: int | None = None
    q: str = ""
    sort: str = "-created"

    @classmethod
    def from_query(cls, params) -> RunFilters:
        sort = params.get("sort", "")
        return cls(status=params.get("status", "") if params.get("status") in RunStatus.values else "",
                   harness=_positive(params.get("harness")), dataset=_positive(params.get("dataset")),
                   q=params.get("q", "").strip()[:200],
                   sort=sort if sort.lstrip("-") in SORTS else cls.sort)

    def query(self, **changes) -> str:
        """The query string of these filters with `changes`, without empty values (for links and the JSON rows)."""
        values = {"status": self.status, "harness": self.harness or "", "dataset": self.dataset or "", "q": self.q,
                  "sort": "" if self.sort == RunFilters.sort else self.sort}
        values.update(changes)
        return urlencode({key: value for key, value in values.items() if value not in ("", None)})

    def sort_link(self, key: str) -> str:
        """The query that sorts by `key`: descending first, ascending when it is already descending."""
        return self.query(sort=key if self.sort == f"-{key}" else f"-{key}", page="")

    @property
    def active(self) -> bool:
        return bool(self.status or self.harness or self.dataset or self.q)


def _positive(value) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def latest_metric(name: str) -> Subquery:
    """The value of `name` at the run's highest step (metric_run_name_step index)."""
    return Subquery(Metric.objects.filter(run=OuterRef("pk"), name=name).order_by("-step").values("value")[:1])


def best_metric(name: str) -> Subquery:
    return Subquery(Metric.objects.filter(run=OuterRef("pk"), name=name).order_by().values("run")
                    .annotate(best=Max("value")).values("best")[:1])


def list_runs(user, filters: RunFilters) -> QuerySet:
    """The user's runs (all for staff) that match `filters`, as dicts of ROW_FIELDS, sorted (ties: newest first)."""
    runs = selectors.owned(Run.objects.all(), user)
    if filters.status:
        runs = runs.filter(status=filters.status)
    if filters.harness:
        runs = runs.filter(harness_id=filters.harness)
    if filters.dataset:
        runs = runs.filter(dataset_id=filters.dataset)
    if filters.q:
        runs = runs.filter(Q(name__icontains=filters.q) | Q(model__icontains=filters.q))
    runs = runs.annotate(latest_reward=latest_metric(REWARD), latest_pass1=latest_metric(PASS1))
    key = SORTS[filters.sort.lstrip("-")]
    order = key.desc(nulls_last=True) if filters.sort.startswith("-") else key.asc(nulls_last=True)
    return runs.order_by(order, "-pk").values(*ROW_FIELDS)


def sparklines(last_steps: dict[int, int], name: str = REWARD,
               points: int = SPARK_POINTS) -> dict[int, list[list[float]]]:
    """The last `points` [step, value] pairs of `name` of each run (run id -> its step), oldest first: one query.

    Only steps after the run's step less 4 x `points` are read (the metric_run_name_step index), so a run of
    10,000 steps costs as little as one of 100.
    """
    window = Q()
    for run_id, step in last_steps.items():
        window |= Q(run_id=run_id, step__gt=step - 4 * points)
    rows = (Metric.objects.filter(window, name=name) if last_steps else Metric.objects.none())
    rows = (rows.annotate(rank=Window(RowNumber(), partition_by=F("run_id"), order_by=F("step").desc()))
            .filter(rank__lte=points).order_by("run_id", "step").values_list("run_id", "step", "value"))
    lines: dict[int, list[list[float]]] = {run_id: [] for run_id in last_steps}
    for run_id, step, value in rows:
        lines[run_id].append([step, value])
    return lines


def page_of_rows(user, filters: RunFilters, number) -> tuple[Page, list[dict[str, Any]]]:
    """One page (PAGE_SIZE) of the list and its rows: four queries (count, runs with metrics, sparklines, alarms)."""
    page = Paginator(list_runs(user, filters), PAGE_SIZE).get_page(number)
    found = list(page.object_list)
    lines = sparklines({run["pk"]: run["step"] for run in found})
    alarms = health_services.open_counts(run["pk"] for run in found)
    now = timezone.now()
    return page, [row(run, lines[run["pk"]], now, alarms.get(run["pk"], 0)) for run in found]


def row(run: dict[str, Any], spark: list[list[float]], now: datetime, alarms: int = 0) -> dict[str, Any]:
    """One row of the runs list, the same shape for the template and the JSON backfill (runs_list.js)."""
    steps = run["config__steps"] if isinstance(run["config__steps"], int) else None
    elapsed = wall_seconds(run["started_at"], run["finished_at"], now)
    return {
        "id": run["pk"], "name": run["name"], "url": f"/runs/{run['pk']}/", "model": run["model"],
        "status": run["status"], "phase": run["phase"] if run["status"] in ACTIVE else "",
        "step": run["step"], "steps": steps,
        "progress": min(1.0, run["step"] / steps) if steps else None,
        "elapsed_s": elapsed, "elapsed": format_seconds(elapsed),
        "ticking": run["status"] in TICKING and run["started_at"] is not None,
        "reward": run["latest_reward"], "pass1": run["latest_pass1"], "spark": spark,
        "harness": run["harness_snapshot__name"] or "", "dataset": run["dataset_snapshot__name"] or "",
        "created": date_format(timezone.localtime(run["created_at"]), "Y-m-d H:i"),
        "created_at": run["created_at"].isoformat(), "event_seq": run["event_seq"],
        "cancellable": run["status"] in ACTIVE - {RunStatus.CANCELLING},
        "alarms": alarms,  # health alarms not acknowledged (the badge; run.alarm events keep it current)
    }


def wall_seconds(started_at: datetime | None, finished_at: datetime | None, now: datetime) -> float | None:
    if started_at is None:
        return None
    return max(0.0, ((finished_at or now) - started_at).total_seconds())


def format_seconds(seconds: float | None) -> str:
    """'45s', '3m 05s', '2h 07m', '3d 04h' (static/js/runs_list.js formats the same way)."""
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


# ---------------------------------------------------------------- comparison


def compared_runs(user, ids: list[int]) -> list[Run]:
    """The runs of `ids` in that order, with latest and best metrics and the step of their last metric (None
    without any), or fewer if some are not the user's."""
    runs = (selectors.owned(Run.objects.all(), user).filter(pk__in=ids)
            .defer("model_info")
            .annotate(latest_reward=latest_metric(REWARD), latest_pass1=latest_metric(PASS1),
                      best_pass1=best_metric(PASS1),
                      last_metric_step=Subquery(Metric.objects.filter(run=OuterRef("pk")).order_by("-step")
                                                .values("step")[:1])))
    by_id = {run.pk: run for run in runs}
    return [by_id[pk] for pk in ids if pk in by_id]


class Joined(Aggregate):
    """A group's values as text joined by commas, in the order its rows come: two Joined of one group line up."""

    function = "GROUP_CONCAT"
    template = "%(function)s(%(expressions)s, ',')"
    output_field = TextField()

    def as_postgresql(self, compiler, connection, **extra):
        return super().as_sql(compiler, connection, function="STRING_AGG",
                              template="%(function)s((%(expressions)s)::text, ',')", **extra)


def metric_series(last_steps: dict[int, int | None],
                  points: int = SERIES_POINTS) -> dict[str, dict[int, dict[str, str]]]:
    """name -> run id -> {"x": "steps", "y": "values"} of every metric of the runs (run id -> the step of its last
    metric), each joined by commas, the pairs in no particular order (static/js/compare.js splits and sorts them):
    one query.

    The database joins the numbers, so a long run costs one row a metric, not one a point. A run with more than
    `points` steps is thinned to every k-th step in SQL (its last step and every `eval/` point kept), so it sends
    about `points` points a metric.
    """
    last = {run_id: step for run_id, step in last_steps.items() if step is not None}
    strides = {run_id: -(-(top + 1) // points) for run_id, top in last.items()}
    rows = Metric.objects.filter(run_id__in=list(last), value__isnull=False)
    thinned = [run_id for run_id, stride in strides.items() if stride > 1]
    if thinned:
        stride = Case(*(When(run_id=run_id, then=Value(strides[run_id])) for run_id in thinned),
                      default=Value(1), output_field=IntegerField())
        last_steps = Q()
        for run_id in thinned:
            last_steps |= Q(run_id=run_id, step=last[run_id])
        rows = rows.alias(step_mod=Mod(F("step"), stride)).filter(
            Q(step_mod=0) | Q(name__startswith="eval/") | last_steps)
    series: dict[str, dict[int, dict[str, str]]] = {}
    # Grouped as the metric_run_name_step index is ordered: no sort, and the steps usually come in order.
    grouped = (rows.order_by().values("run_id", "name").annotate(x=Joined("step"), y=Joined("value"))
               .order_by("run_id", "name").values_list("run_id", "name", "x", "y"))
    for run_id, name, x, y in grouped:
        series.setdefault(name, {})[run_id] = {"x": x, "y": y}
    return series
