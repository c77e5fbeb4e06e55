"""The runs list (the dashboard's home): filters, sort and pages in SQL, its JSON rows for live backfill, bulk
cancel, and the empty dashboard's "Start the demo run" button."""
from __future__ import annotations

import logging
from urllib.parse import parse_qsl, urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.views.decorators.http import require_GET, require_POST

from catalog import selectors
from catalog.models import Dataset, Harness, RewardScript
from common import errors as common_errors
from dashboard import run_summaries
from dashboard.run_summaries import RunFilters
from runs import services
from runs.management.commands.load_demo import start_demo_run
from runs.models import Run, RunStatus

logger = logging.getLogger(__name__)
BULK_LIMIT = 200


@login_required
@require_GET
def runs_list(request):
    return _render_list(request)


def _render_list(request, demo_error: str = "", status: int = 200):
    filters = RunFilters.from_query(request.GET)
    page, rows = run_summaries.page_of_rows(request.user, filters, request.GET.get("page"))
    harnesses = list(selectors.owned(Harness.objects.all(), request.user).order_by("name").values("pk", "name"))
    datasets = list(selectors.owned(Dataset.objects.all(), request.user).order_by("name").values("pk", "name"))
    return render(request, "runs/list.html", {
        "rows": rows, "page": page, "filters": filters, "statuses": RunStatus.choices,
        "harnesses": harnesses, "datasets": datasets,
        "empty": not rows and not filters.active,
        "counts": {"harnesses": len(harnesses), "datasets": len(datasets),
                   "reward_scripts": selectors.owned(RewardScript.objects.all(), request.user).count()},
        "columns": _columns(filters),
        "pages": {"previous": filters.query(page=page.number - 1), "next": filters.query(page=page.number + 1)},
        "demo_error": demo_error,
    }, status=status)


COLUMNS = (("name", "Name"), ("status", "Status"), ("step", "Step"), ("", "Elapsed"), ("reward", "Reward"),
           ("pass1", "Pass@1"), ("", "Reward trend"), ("", "Harness"), ("", "Dataset"), ("", "Model"),
           ("created", "Created"))


def _columns(filters: RunFilters) -> list[dict]:
    """The table's headers: sortable ones link to their sort (descending first) and show the current direction."""
    return [{"sort": key, "label": label, "num": key in ("reward", "pass1"),
             "link": filters.sort_link(key) if key else "",
             "arrow": " ↓" if filters.sort == f"-{key}" else " ↑" if filters.sort == key else ""}
            for key, label in COLUMNS]


@login_required
@require_GET
def runs_rows(request):
    """The rows the list shows for the same GET parameters, as JSON: runs_list.js backfills from it."""
    filters = RunFilters.from_query(request.GET)
    page, rows = run_summaries.page_of_rows(request.user, filters, request.GET.get("page"))
    return JsonResponse({"rows": rows, "page": page.number, "pages": page.paginator.num_pages,
                         "count": page.paginator.count})


@login_required
@require_POST
def bulk_cancel(request):
    """Cancel the selected runs one by one through services.cancel_run; report each that could not be and why."""
    wanted = _ids(request.POST.getlist("ids"))[:BULK_LIMIT]
    runs = {run.pk: run for run in selectors.owned(Run.objects.filter(pk__in=wanted).only("pk", "name", "owner_id",
                                                                                          "status"), request.user)}
    cancelled, refused = [], []
    for pk in wanted:
        run = runs.get(pk)
        if run is None:
            refused.append(f"#{pk}: no such run of yours")
            continue
        try:
            run = services.cancel_run(run, request.user)
        except common_errors.ServiceError as exc:
            refused.append(f"#{pk} {run.name}: {exc}")
        else:
            cancelled.append(f"#{pk} {run.name} ({run.status})")
    if not wanted:
        messages.error(request, "Select the runs to cancel first.", extra_tags="bulk-cancel")
    if cancelled:
        messages.success(request, f"Cancelled {len(cancelled)}: {', '.join(cancelled)}", extra_tags="bulk-cancel")
    for line in refused:
        messages.error(request, f"Not cancelled {line}", extra_tags="bulk-cancel")
    logger.info("user %s bulk-cancelled runs %s (%d refused)", request.user.pk, wanted, len(refused))
    back = urlencode(parse_qsl(request.POST.get("back", "").lstrip("?")))  # only a query of this page: no open redirect
    return redirect(reverse("runs-list") + (f"?{back}" if back else ""))


def _ids(values: list[str]) -> list[int]:
    ids = []
    for value in values:
        for part in value.split(","):
            if part.strip().isdigit() and int(part) not in ids:
                ids.append(int(part))
    return ids


@login_required
@require_POST
def start_demo(request):
    """The empty dashboard's "Start the demo run" button: the preset of examples/arith/preset.json."""
    try:
        run = start_demo_run(request.user)
    except common_errors.ServiceError as exc:
        return _render_list(request, demo_error=str(exc), status=409)
    return redirect("run-detail", run_id=run.pk)


urlpatterns = [
    path("", runs_list, name="runs-list"),
    path("runs/rows/", runs_rows, name="runs-rows"),
    path("runs/cancel/", bulk_cancel, name="runs-bulk-cancel"),
    path("runs/demo/", start_demo, name="run-demo"),
]
