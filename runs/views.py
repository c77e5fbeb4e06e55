"""Server-rendered dashboard pages (login required); data comes from selectors, live updates over websockets."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render

from runs import selectors, services
from runs.forms import RunForm
from runs.models import Dataset, Harness, RewardScript, Run


@login_required
def runs_list(request):
    runs = selectors.owned(Run.objects.select_related("harness", "dataset"), request.user)[:200]
    counts = {
        "harnesses": selectors.owned(Harness.objects.all(), request.user).count(),
        "datasets": selectors.owned(Dataset.objects.all(), request.user).count(),
        "reward_scripts": selectors.owned(RewardScript.objects.all(), request.user).count(),
    }
    return render(request, "runs/list.html", {"runs": runs, "counts": counts})


@login_required
def run_detail(request, run_id: int):
    run = get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)
    return render(request, "runs/detail.html", {"run": run, "last_seq": 0})


@login_required
def new_run(request):
    """Launch a run: the same validation as the API (TrainerConfig, registry, ownership) through services."""
    form = RunForm(request.user, request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            run = services.create_run(request.user, **form.cleaned_data)
        except services.ServiceError as exc:
            form.add_error(None, str(exc))
        else:
            return redirect("run-detail", run_id=run.pk)
    return render(request, "runs/new.html", {"form": form})
