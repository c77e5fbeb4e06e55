"""A run's page (header, live charts, rollouts table, event log), its actions (cancel, resume, continue), the JSON
its scripts read (metric series, a page of rollouts), and a rollout's page."""
from __future__ import annotations

import json
import statistics
from datetime import datetime

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from runs import events, rollout_queries, selectors, services
from runs.models import Rollout, RolloutStatus, Run, RunEvent, RunStatus

CANCELLABLE = (RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING)
ETA_WINDOW = 20  # recent steps whose median time the ETA uses (static/js/run_events.js uses as many)


def _owned_run(request, run_id: int) -> Run:
    return get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)


@login_required
@require_GET
def run_detail(request, run_id: int):
    return _render_detail(request, _owned_run(request, run_id))


def _render_detail(request, run: Run, action_error: str = "", status: int = 200):
    return render(request, "runs/detail.html", {
        "run": run, "header": run_header(run), "cancellable": run.status in CANCELLABLE,
        "action_error": action_error, "rollout_statuses": RolloutStatus.values,
        "page_config": {"run": run.pk, "name": run.name, "status": run.status, "step": run.step,
                        "steps": _total_steps(run), "started_at": _iso(run.started_at),
                        "finished_at": _iso(run.finished_at), "last_seq": run.event_seq},
    }, status=status)


def _total_steps(run: Run) -> int | None:
    steps = (run.config or {}).get("steps")
    return int(steps) if isinstance(steps, (int, float)) else None


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def run_header(run: Run) -> dict:
    """Elapsed time and ETA as the page first shows them; the page's script keeps both current from events.

    The ETA is the median of the last ETA_WINDOW measured step times (`time/step`) times the steps left: one slow
    step (the first one compiles, an evaluation lands in another) does not swing it, and a run that sped up or
    slowed down is estimated at its current pace.
    """
    end = run.finished_at or timezone.now()
    elapsed = (end - run.started_at).total_seconds() if run.started_at else None
    total = _total_steps(run)
    eta = None
    if total is not None and not run.is_finished and run.status != RunStatus.QUEUED:
        step_times = list(selectors.run_metrics(run, ["time/step"]).order_by("-step")
                          .values_list("value", flat=True)[:ETA_WINDOW])
        if step_times:
            eta = statistics.median(step_times) * max(0, total - run.step)
    return {"steps": total, "elapsed": elapsed, "elapsed_text": duration_text(elapsed),
            "eta": eta, "eta_text": duration_text(eta), "phase": phase_now(run, total)}


def phase_now(run: Run, total: int | None) -> str:
    """What the run is doing: its phase, unless a step was recorded since (then the next step is under way).

    The engine's start and evaluations say their phase; between them a running run generates and trains
    (static/js/run_events.js says the same after each live step).
    """
    if run.is_finished:
        return ""
    if run.status == RunStatus.RUNNING and total is not None and run.step < total:
        last = (RunEvent.objects.filter(run=run, kind__in=(events.RUN_PHASE, events.RUN_METRICS))
                .order_by("-seq").values_list("kind", flat=True).first())
        if last != events.RUN_PHASE:
            return f"step {run.step + 1}: generating rollouts and training"
    return run.phase


def duration_text(seconds: float | None) -> str:
    """'42s', '3m 05s', '2h 07m' (the same format as static/js/run_page.js)."""
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


@login_required
@require_POST
def run_cancel(request, run_id: int):
    run = _owned_run(request, run_id)
    try:
        services.cancel_run(run, request.user)
    except services.ServiceError as exc:
        run.refresh_from_db()
        return _render_detail(request, run, str(exc), status=409)
    return redirect("run-detail", run_id=run.pk)


@login_required
@require_POST
def run_go_on(request, run_id: int, how: str):
    """The run page's Resume (failed or cancelled) and Continue (succeeded, for N more steps) buttons."""
    run = _owned_run(request, run_id)
    try:
        if how == "resume":
            services.resume_run(run, request.user)
        else:
            services.continue_run(run, request.user, _whole_number(request.POST.get("steps")))
    except services.ServiceError as exc:
        run.refresh_from_db()
        return _render_detail(request, run, str(exc), status=409)
    return redirect("run-detail", run_id=run.pk)


def _whole_number(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise services.ServiceError(f"steps must be a whole number, got {value!r}") from None


@login_required
@require_GET
def run_metric_series(request, run_id: int):
    """The run's stored metrics as one series a name: {name: {step: [...], value: [...], t: [...]}} in one query.

    The charts load this once, then extend it from the run's events. `name` (repeated or comma-separated) picks
    the metrics; `t` is when each value was recorded (the charts' wall-time axis).
    """
    run = _owned_run(request, run_id)
    names = [n for item in request.GET.getlist("name") for n in item.split(",") if n]
    series: dict[str, dict[str, list]] = {}
    for name, step, value, created_at in selectors.run_metrics(run, names).values_list(
            "name", "step", "value", "created_at"):
        entry = series.setdefault(name, {"step": [], "value": [], "t": []})
        entry["step"].append(step)
        entry["value"].append(value)
        entry["t"].append(created_at.isoformat())
    return JsonResponse({"run": run.pk, "metrics": series})


@login_required
@require_GET
def run_rollouts(request, run_id: int):
    """A page of the run's rollouts for the table (filters, sort and page in the query string; see rollout_queries)."""
    run = _owned_run(request, run_id)
    try:
        query = rollout_queries.RolloutQuery.from_params(request.GET)
    except rollout_queries.QueryError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(rollout_queries.rollouts_page(run, query))


@login_required
@require_GET
def rollout_detail(request, rollout_id: int):
    """One rollout: what it ran on, how it ended, its output and the list of its calls (the inspector comes later)."""
    rollout = get_object_or_404(selectors.owned(Rollout.objects.select_related("run", "task"), request.user),
                                pk=rollout_id)
    run = rollout.run
    task = run.harness_task(rollout.task.data) if rollout.task is not None else None
    duration = ((rollout.finished_at - rollout.started_at).total_seconds()
                if rollout.finished_at and rollout.started_at else None)
    return render(request, "runs/rollout.html", {
        "rollout": rollout, "run": run, "calls": rollout_queries.rollout_calls(rollout),
        "duration_text": duration_text(duration) if duration is not None else "",
        "task_json": _pretty(task) if task is not None else "",
        "reward_detail_json": _pretty(rollout.reward_detail) if rollout.reward_detail else "",
    })


def _pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


urlpatterns = [
    path("runs/<int:run_id>/", run_detail, name="run-detail"),
    path("runs/<int:run_id>/cancel/", run_cancel, name="run-cancel"),
    path("runs/<int:run_id>/resume/", run_go_on, {"how": "resume"}, name="run-resume"),
    path("runs/<int:run_id>/continue/", run_go_on, {"how": "continue"}, name="run-continue"),
    path("runs/<int:run_id>/series/", run_metric_series, name="run-metric-series"),
    path("runs/<int:run_id>/rollouts/", run_rollouts, name="run-rollouts-table"),
    path("rollouts/<int:rollout_id>/", rollout_detail, name="rollout-detail"),
]
