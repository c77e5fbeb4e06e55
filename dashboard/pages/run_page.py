"""A run's page (header, live charts, rollouts table, event log), its actions (cancel, finish, resume, continue), and the JSON
its scripts read (metric series, a page of rollouts). A rollout's page is dashboard/pages/rollout_page.py."""
from __future__ import annotations

import statistics
from datetime import datetime

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from catalog import selectors as catalog_selectors
from common import errors as common_errors
from dashboard import rollout_queries
from dashboard.pages import health_pages
from runs import pools, selectors, services, signal
from runs.models import RolloutStatus, Run, RunStatus

CANCELLABLE = (RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING)
FINISHABLE = (RunStatus.STARTING, RunStatus.RUNNING)  # services.finish_run
ETA_WINDOW = 20  # recent steps whose median time the ETA uses (static/js/run_events.js uses as many)


def _owned_run(request, run_id: int) -> Run:
    return get_object_or_404(catalog_selectors.owned(Run.objects.all(), request.user), pk=run_id)


@login_required
@require_GET
def run_detail(request, run_id: int):
    return _render_detail(request, _owned_run(request, run_id))


def _render_detail(request, run: Run, action_error: str = "", status: int = 200):
    header = run_header(run)
    return render(request, "runs/detail.html", {
        **health_pages.health_context(request, run),
        "run": run, "header": header, "cancellable": run.status in CANCELLABLE,
        "finishable": run.status in FINISHABLE and (_total_steps(run) or 0) > run.step + 1,
        "action_error": action_error, "rollout_statuses": RolloutStatus.values,
        "page_config": {"run": run.pk, "name": run.name, "status": run.status, "step": run.step,
                        "steps": _total_steps(run), "started_at": _iso(run.started_at),
                        "finished_at": _iso(run.finished_at), "last_seq": run.event_seq,
                        # the signal notice's inputs, which the page's script extends from run.metrics events
                        "signal": {"dynamic_sampling": header["signal"]["dynamic_sampling"],
                                   "low_share": signal.LOW_SHARE, "window": signal.WINDOW,
                                   "steps": [{"step": r["step"], "share": r["sampled_signal_share"],
                                              "dropped": r["groups_dropped_no_signal"]}
                                             for r in header["signal"]["steps"][-signal.WINDOW:]]}},
    }, status=status)


def _total_steps(run: Run) -> int | None:
    steps = (run.config or {}).get("steps")
    return int(steps) if isinstance(steps, (int, float)) else None


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def run_header(run: Run) -> dict:
    """Elapsed time and ETA as the page first shows them; the page's script keeps both current from events.

    `signal` is runs.signal.summary over those steps: its notice warns when the groups lose their learning signal.
    The ETA is the median step time (`time/step`) of the last ETA_WINDOW steps times the steps left: one slow
    step (the first one compiles, an evaluation lands in another) does not swing it, and a run that sped up or
    slowed down is estimated at its current pace.
    """
    end = run.finished_at or timezone.now()
    elapsed = (end - run.started_at).total_seconds() if run.started_at else None
    total = _total_steps(run)
    # One query for both the ETA's step times and the signal notice: the metrics of the last ETA_WINDOW steps.
    recent = signal.metrics_by_step(run, ["time/step", *signal.METRICS], step_min=run.step - ETA_WINDOW + 1)
    eta = None
    if total is not None and not run.is_finished and run.status != RunStatus.QUEUED:
        step_times = [v["time/step"] for _, v in sorted(recent.items()) if "time/step" in v]
        if step_times:
            eta = statistics.median(step_times) * max(0, total - run.step)
    return {"steps": total, "elapsed": elapsed, "elapsed_text": duration_text(elapsed),
            "eta": eta, "eta_text": duration_text(eta), "phase": phase_now(run),
            "waiting": pools.waiting(run), "worker": pools.started_on(run), "signal": signal.summary(run, recent)}


def phase_now(run: Run) -> str:
    """What the run is doing, as its worker last said (the scheduler's phases: generating, training, syncing,
    checkpoint, recording; the engine's start; evaluations); nothing once it has finished."""
    return "" if run.is_finished else run.phase


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
    return _act(request, run_id, services.cancel_run)


@login_required
@require_POST
def run_finish(request, run_id: int):
    """The Finish button: the step in progress becomes the run's last (services.finish_run)."""
    return _act(request, run_id, services.finish_run)


def _act(request, run_id: int, action) -> object:
    """Apply `action(run, user)` to the user's run: back to its page, or the page with the refusal (409)."""
    run = _owned_run(request, run_id)
    try:
        action(run, request.user)
    except common_errors.ServiceError as exc:
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
    except common_errors.ServiceError as exc:
        run.refresh_from_db()
        return _render_detail(request, run, str(exc), status=409)
    return redirect("run-detail", run_id=run.pk)


def _whole_number(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise common_errors.ServiceError(f"steps must be a whole number, got {value!r}") from None


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


urlpatterns = [
    path("runs/<int:run_id>/", run_detail, name="run-detail"),
    path("runs/<int:run_id>/cancel/", run_cancel, name="run-cancel"),
    path("runs/<int:run_id>/finish/", run_finish, name="run-finish"),
    path("runs/<int:run_id>/resume/", run_go_on, {"how": "resume"}, name="run-resume"),
    path("runs/<int:run_id>/continue/", run_go_on, {"how": "continue"}, name="run-continue"),
    path("runs/<int:run_id>/series/", run_metric_series, name="run-metric-series"),
    path("runs/<int:run_id>/rollouts/", run_rollouts, name="run-rollouts-table"),
]
