"""Reads behind the run page's rollouts table: filtered, sorted and paged in SQL.

A fixed number of queries whatever the run's size; no query here reads a call's JSON blobs (request, response,
token ids). CALL_COLUMNS serves the rollout page too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.db.models import DurationField, ExpressionWrapper, F, Q, QuerySet
from django.db.models.functions import Substr

from catalog.models import Split, Task
from runs.models import Rollout, RolloutStatus, Run

PAGE_SIZE = 25
MAX_PAGE_SIZE = 200
SORTS = {  # the table's sort keys -> ORDER BY (nulls last both ways; id breaks ties so pages never overlap)
    "newest": (F("id").desc(),),
    "oldest": (F("id").asc(),),
    "reward": (F("reward").asc(nulls_last=True), F("id").asc()),
    "-reward": (F("reward").desc(nulls_last=True), F("id").desc()),
    "duration": (F("duration").asc(nulls_last=True), F("id").asc()),
    "-duration": (F("duration").desc(nulls_last=True), F("id").desc()),
    "calls": (F("call_count").asc(), F("id").asc()),
    "-calls": (F("call_count").desc(), F("id").desc()),
}
ERROR_PREVIEW = 200  # characters of a rollout's error the table shows (cut in SQL)


class QueryError(ValueError):
    """A filter or sort the table does not know; the message names the parameter and what it accepts."""


@dataclass(frozen=True)
class RolloutQuery:
    """The table's filters, sort and page, parsed from a query string."""

    step: int | None = None
    split: str = ""
    status: str = ""
    reward_min: float | None = None
    reward_max: float | None = None
    text: str = ""
    sort: str = "newest"
    page: int = 1
    page_size: int = PAGE_SIZE

    @classmethod
    def from_params(cls, params) -> RolloutQuery:
        split, status, sort = params.get("split", ""), params.get("status", ""), params.get("sort", "") or "newest"
        if split and split not in Split.values:
            raise QueryError(f"split must be one of {Split.values}, got {split!r}")
        if status and status not in RolloutStatus.values:
            raise QueryError(f"status must be one of {RolloutStatus.values}, got {status!r}")
        if sort not in SORTS:
            raise QueryError(f"sort must be one of {list(SORTS)}, got {sort!r}")
        return cls(step=_number(params, "step", int, minimum=0), split=split, status=status,
                   reward_min=_number(params, "reward_min", float), reward_max=_number(params, "reward_max", float),
                   text=params.get("q", "").strip()[:200], sort=sort,
                   page=_number(params, "page", int, minimum=1) or 1,
                   page_size=min(_number(params, "page_size", int, minimum=1) or PAGE_SIZE, MAX_PAGE_SIZE))

    def filter(self, rows: QuerySet, run: Run | None = None) -> QuerySet:
        """`run`: the text search matches task ids within the run's dataset (a subquery on the task index) rather
        than joining every rollout to its task."""
        conditions = Q()
        if self.step is not None:
            conditions &= Q(step=self.step)
        if self.split:
            conditions &= Q(split=self.split)
        if self.status:
            conditions &= Q(status=self.status)
        if self.reward_min is not None:
            conditions &= Q(reward__gte=self.reward_min)
        if self.reward_max is not None:
            conditions &= Q(reward__lte=self.reward_max)
        if self.text:
            if run is None:
                by_task = Q(task__external_id__icontains=self.text)
            else:
                by_task = Q(task__in=Task.objects.filter(dataset_id=run.dataset_id,
                                                         external_id__icontains=self.text).order_by().values("pk"))
            conditions &= by_task | (~Q(error="") & Q(error__icontains=self.text))
        return rows.filter(conditions)


def _number(params, name: str, kind: type, minimum: float | None = None):
    value = params.get(name, "")
    if value in ("", None):
        return None
    try:
        number = kind(value)
    except ValueError:
        raise QueryError(f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise QueryError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise QueryError(f"{name} must be at least {minimum}, got {value!r}")
    return number


def rollouts_page(run: Run, query: RolloutQuery) -> dict[str, Any]:
    """One page of the run's rollouts as the table shows them: two queries (count, then the page's rows)."""
    rows = query.filter(Rollout.objects.filter(run=run), run)
    count = rows.count()
    pages = max(1, math.ceil(count / query.page_size))
    page = min(query.page, pages)
    start = (page - 1) * query.page_size
    selected = (rows.annotate(duration=ExpressionWrapper(F("finished_at") - F("started_at"),
                                                         output_field=DurationField()),
                              error_preview=Substr("error", 1, ERROR_PREVIEW))
                .order_by(*SORTS[query.sort])
                .values("id", "step", "split", "group", "attempt", "greedy", "status", "failure_kind", "reward",
                        "call_count", "duration", "error_preview", "task__external_id", "created_at", "flags")
                [start:start + query.page_size])
    return {"count": count, "page": page, "pages": pages, "page_size": query.page_size, "sort": query.sort,
            "results": [_row(r) for r in selected]}


def _row(r: dict[str, Any]) -> dict[str, Any]:
    duration = r["duration"]
    return {"id": r["id"], "step": r["step"], "split": r["split"], "group": r["group"], "attempt": r["attempt"],
            "greedy": r["greedy"], "status": r["status"], "failure_kind": r["failure_kind"], "reward": r["reward"],
            "calls": r["call_count"], "duration_s": duration.total_seconds() if duration is not None else None,
            "task": r["task__external_id"] or "", "error": r["error_preview"] or "",
            "created_at": r["created_at"].isoformat(), "flags": list(r.get("flags") or [])}


CALL_COLUMNS = ("seq", "api", "stream", "status_code", "latency_ms", "finish_reason", "drift", "policy_version",
                "error", "replica", "retried", "created_at")
