"""Non-trivial reads: what a user may see, event replay, metric queries."""
from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from runs import events
from runs.models import Metric, Run, RunEvent


def owned(queryset: QuerySet, user) -> QuerySet:
    """Rows the user may see: their own, or all for staff. `owner` may be reached through a relation."""
    if user.is_staff:
        return queryset
    field = {"Task": "dataset__owner", "Rollout": "run__owner", "ModelCall": "rollout__run__owner",
             "Sample": "rollout__run__owner"}.get(queryset.model.__name__, "owner")
    return queryset.filter(**{field: user})


def user_can_see_run(user, run_id: int) -> bool:
    return owned(Run.objects.filter(pk=run_id), user).exists()


def run_events_after(run_id: int, after: int, limit: int = 500) -> list[dict[str, Any]]:
    rows = RunEvent.objects.filter(run_id=run_id, seq__gt=after).order_by("seq")[:limit]
    return [events.from_row(row) for row in rows]


def run_metrics(run: Run, names: list[str] | None = None, step_min: int | None = None,
                step_max: int | None = None) -> QuerySet:
    rows = Metric.objects.filter(run=run)
    if names:
        rows = rows.filter(name__in=names)
    if step_min is not None:
        rows = rows.filter(step__gte=step_min)
    if step_max is not None:
        rows = rows.filter(step__lte=step_max)
    return rows.order_by("name", "step", "id")
