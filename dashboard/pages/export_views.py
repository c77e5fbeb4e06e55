"""The run page's export button: the run's rollouts, filtered as the rollouts table is, as a JSONL download."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import path
from django.views.decorators.http import require_GET

from catalog import selectors
from dashboard import export
from dashboard.rollout_queries import QueryError, RolloutQuery
from runs.models import Run


@login_required
@require_GET
def run_export(request, run_id: int):
    """Streamed JSONL (docs/export-schema.md); a filter the table does not know answers 400 with the reason."""
    run = get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)
    try:
        query = RolloutQuery.from_params(request.GET)
    except QueryError as exc:
        return HttpResponse(str(exc), status=400, content_type="text/plain; charset=utf-8")
    return export.export_response(request, run, query)


urlpatterns = [
    path("runs/<int:run_id>/export.jsonl", run_export, name="run-export"),
]
