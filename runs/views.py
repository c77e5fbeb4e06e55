"""Server-rendered dashboard pages (login required); data comes from selectors, live updates over websockets."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render

from runs import selectors
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
