"""The run inspector's pages: the validation grid's JSON, the list of trained steps, and a step's page (GRPO groups,
dropped rollouts, rollout timeline) with its JSON. Owner-only; reads in dashboard.inspect_queries."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path
from django.views.decorators.http import require_GET

from catalog import selectors
from dashboard import inspect_queries
from runs.models import Run


def _owned_run(request, run_id: int) -> Run:
    return get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)


@login_required
@require_GET
def run_val_grid(request, run_id: int):
    """Val tasks by evaluated steps, each cell's state and each task's flags (see dashboard.inspect_queries)."""
    run = _owned_run(request, run_id)
    return JsonResponse({"run": run.pk, **inspect_queries.val_grid(run)})


@login_required
@require_GET
def run_steps(request, run_id: int):
    """The run's trained steps with a few of their metrics, for the run page's Steps section."""
    run = _owned_run(request, run_id)
    return JsonResponse({"run": run.pk, "steps": inspect_queries.step_list(run)})


@login_required
@require_GET
def run_step_data(request, run_id: int, step: int):
    run = _owned_run(request, run_id)
    return JsonResponse(inspect_queries.step_data(run, step))


@login_required
@require_GET
def run_step(request, run_id: int, step: int):
    """Step `step` of the run: its groups, what it dropped, and its rollouts on a timeline over the run's phases."""
    run = _owned_run(request, run_id)
    data = inspect_queries.step_data(run, step)
    return render(request, "runs/step.html", {
        "run": run, "step": step, "data": data, "previous": step - 1 if step > 1 else None,
        "next": step + 1 if step < run.step else None,
        "page_config": {"run": run.pk, "step": step, "timeline": data["timeline"]},
    })


urlpatterns = [
    path("runs/<int:run_id>/val-grid.json", run_val_grid, name="run-val-grid"),
    path("runs/<int:run_id>/steps.json", run_steps, name="run-steps"),
    path("runs/<int:run_id>/steps/<int:step>/", run_step, name="run-step"),
    path("runs/<int:run_id>/steps/<int:step>.json", run_step_data, name="run-step-data"),
]
