"""The runs list (the dashboard's home) and its "Start the demo run" button."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_POST

from runs import selectors, services
from runs.management.commands.load_demo import start_demo_run
from runs.models import Dataset, Harness, RewardScript, Run


@login_required
def runs_list(request, demo_error: str = ""):
    runs = selectors.owned(Run.objects.select_related("harness", "dataset"), request.user)[:200]
    counts = {
        "harnesses": selectors.owned(Harness.objects.all(), request.user).count(),
        "datasets": selectors.owned(Dataset.objects.all(), request.user).count(),
        "reward_scripts": selectors.owned(RewardScript.objects.all(), request.user).count(),
    }
    return render(request, "runs/list.html", {"runs": runs, "counts": counts, "demo_error": demo_error})


@login_required
@require_POST
def start_demo(request):
    """The empty dashboard's "Start the demo run" button: the preset of examples/arith/preset.json."""
    try:
        run = start_demo_run(request.user)
    except services.ServiceError as exc:
        response = runs_list(request, demo_error=str(exc))
        response.status_code = 409
        return response
    return redirect("run-detail", run_id=run.pk)


urlpatterns = [
    path("", runs_list, name="runs-list"),
    path("runs/demo/", start_demo, name="run-demo"),
]
