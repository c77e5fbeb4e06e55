"""Reads every page and API view shares: what a user may see (owned rows), and a dataset's task browser."""
from __future__ import annotations

from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast

from catalog.models import Dataset, Task

OWNER_PATHS = {"Task": "dataset__owner", "Rollout": "run__owner", "ModelCall": "rollout__run__owner",
               "Sample": "rollout__run__owner"}
"""How a model without an `owner` of its own reaches its owner."""


def owned(queryset: QuerySet, user) -> QuerySet:
    """Rows the user may see: their own, or all for staff. `owner` may be reached through a relation."""
    if user.is_staff:
        return queryset
    return queryset.filter(**{OWNER_PATHS.get(queryset.model.__name__, "owner"): user})


def owner_id_of(obj) -> int | None:
    """The id of the user who owns `obj`, through the same relations as `owned` (None for an unowned object)."""
    *hops, _ = OWNER_PATHS.get(type(obj).__name__, "owner").split("__")
    for hop in hops:
        obj = getattr(obj, hop, None)
        if obj is None:
            return None
    return getattr(obj, "owner_id", None)


def browse_tasks(dataset: Dataset, split: str = "", query: str = ""):
    """The dataset's tasks in file order, filtered by split and by text in the id or the task's JSON, in SQL."""
    tasks = Task.objects.filter(dataset=dataset).order_by("index")
    if split:
        tasks = tasks.filter(split=split)
    if query:
        tasks = tasks.annotate(data_text=Cast("data", TextField())).filter(
            Q(external_id__icontains=query) | Q(data_text__icontains=query))
    return tasks.only("pk", "index", "external_id", "split", "data")
