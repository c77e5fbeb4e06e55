"""Run health on the dashboard: the run page's alarm panel (and its partial, which the page reloads on each
`run.alarm` event), acknowledging an alarm, starting a re-scoring, and a re-scoring's page (old and new reward side
by side, what changed, Pass@1 recomputed)."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path, reverse
from django.views.decorators.http import require_GET, require_POST

from catalog import selectors as catalog_selectors
from catalog.models import RewardScript
from common import errors as common_errors
from health import rescoring
from health import services as health_services
from health.models import Rescore, RescoreScope, RescoreStatus, RunAlarm
from runs.models import Run

RESULTS_PAGE = 100


def _owned_run(request, run_id: int) -> Run:
    return get_object_or_404(catalog_selectors.owned(Run.objects.all(), request.user), pk=run_id)


def health_context(request, run: Run) -> dict:
    """What templates/runs/_run_health.html draws: the alarms, the re-scoring form's choices and past re-scorings."""
    alarms = list(run.alarms.select_related("acknowledged_by").order_by("-step", "kind"))
    # The train rollouts the lens flagged, from the steps' reward_hacking alarms (each counts its step's): the
    # page reads no rollout row, whatever the run's size.
    flagged = sum(int(a.evidence.get("flagged") or 0) for a in alarms if a.kind == "reward_hacking")
    return {"alarms": alarms, "open_alarms": sum(a.acknowledged_at is None for a in alarms),
            "reward_scripts": catalog_selectors.owned(RewardScript.objects.all(), request.user).order_by("name"),
            "rescore_scopes": RescoreScope.choices, "rescores": run.rescores.all()[:10], "flagged_rollouts": flagged}


@login_required
@require_GET
def health_panel(request, run_id: int):
    run = _owned_run(request, run_id)
    return render(request, "runs/_run_health.html", {"run": run, **health_context(request, run)})


@login_required
@require_POST
def alarm_acknowledge(request, run_id: int, alarm_id: int):
    alarm = get_object_or_404(RunAlarm, run=_owned_run(request, run_id), pk=alarm_id)
    try:
        health_services.acknowledge(alarm, request.user)
    except common_errors.ServiceError as exc:
        messages.error(request, str(exc), extra_tags="health")
    return redirect(reverse("run-detail", args=[run_id]) + "#health")


@login_required
@require_POST
def rescore_start(request, run_id: int):
    run = _owned_run(request, run_id)
    script = catalog_selectors.owned(RewardScript.objects.all(), request.user).filter(
        pk=_int(request.POST.get("reward_script"))).first()
    scope = request.POST.get("scope") or RescoreScope.ALL
    step = _int(request.POST.get("step")) if scope == RescoreScope.STEP else None
    if script is None:
        messages.error(request, "Pick one of your reward scripts to re-score with.", extra_tags="health")
        return redirect(reverse("run-detail", args=[run_id]) + "#health")
    try:
        rescore = rescoring.start_rescore(request.user, run, script, scope, step)
    except common_errors.ServiceError as exc:
        messages.error(request, f"Not re-scored: {exc}", extra_tags="health")
        return redirect(reverse("run-detail", args=[run_id]) + "#health")
    return redirect("run-rescore", run_id=run_id, rescore_id=rescore.pk)


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@login_required
@require_GET
def rescore_detail(request, run_id: int, rescore_id: int):
    run = _owned_run(request, run_id)
    rescore = get_object_or_404(Rescore, run=run, pk=rescore_id)
    rows = rescore.results.select_related("rollout", "rollout__task").order_by("rollout_id")
    only_changed = request.GET.get("changed") == "1"
    page = Paginator(rows.changed() if only_changed else rows, RESULTS_PAGE).get_page(request.GET.get("page"))
    running = rescore.status in (RescoreStatus.QUEUED, RescoreStatus.RUNNING)
    return render(request, "runs/rescore.html", {
        "run": run, "rescore": rescore, "page": page, "only_changed": only_changed, "running": running,
        "splits": sorted((rescore.summary or {}).get("splits", {}).items()),
        "val_by_step": (rescore.summary or {}).get("val_by_step", [])})


urlpatterns = [
    path("runs/<int:run_id>/health/", health_panel, name="run-health"),
    path("runs/<int:run_id>/alarms/<int:alarm_id>/acknowledge/", alarm_acknowledge, name="run-alarm-acknowledge-page"),
    path("runs/<int:run_id>/rescores/", rescore_start, name="run-rescore-start"),
    path("runs/<int:run_id>/rescores/<int:rescore_id>/", rescore_detail, name="run-rescore"),
]
