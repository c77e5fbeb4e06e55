"""A run's page: header, live charts, rollouts table, event log; resume and continue."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_POST

from runs import selectors, services
from runs.models import Run


@login_required
def run_detail(request, run_id: int):
    run = get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)
    return render(request, "runs/detail.html", {"run": run, "last_seq": 0})


@login_required
@require_POST
def run_go_on(request, run_id: int, how: str):
    """The run page's Resume (failed or cancelled) and Continue (succeeded, for N more steps) buttons."""
    run = get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)
    try:
        if how == "resume":
            services.resume_run(run, request.user)
        else:
            services.continue_run(run, request.user, _whole_number(request.POST.get("steps")))
    except services.ServiceError as exc:
        return render(request, "runs/detail.html", {"run": run, "last_seq": 0, "action_error": str(exc)}, status=409)
    return redirect("run-detail", run_id=run.pk)


def _whole_number(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise services.ServiceError(f"steps must be a whole number, got {value!r}") from None


urlpatterns = [
    path("runs/<int:run_id>/", run_detail, name="run-detail"),
    path("runs/<int:run_id>/resume/", run_go_on, {"how": "resume"}, name="run-resume"),
    path("runs/<int:run_id>/continue/", run_go_on, {"how": "continue"}, name="run-continue"),
]
