"""Server-rendered dashboard pages (login required); data comes from selectors, live updates over websockets."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from runs import selectors, services
from runs.forms import RunForm
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


@login_required
def new_run(request):
    """Launch a run: the same validation as the API (TrainerConfig, registry, ownership) through services.

    `?clone=<id>` fills the form from one of the user's runs ("Clone and edit") and records it as the origin.
    """
    clone = _clone_source(request)
    form = RunForm(request.user, request.POST or None, clone=clone)
    if request.method == "POST" and form.is_valid():
        try:
            run = services.create_run(request.user, **form.run_arguments(), cloned_from=clone)
        except services.ServiceError as exc:
            form.add_service_error(exc)
        else:
            return redirect("run-detail", run_id=run.pk)
    return render(request, "runs/new.html", {"form": form, "clone": clone})


def _clone_source(request) -> Run | None:
    run_id = request.GET.get("clone")
    if run_id is None:
        return None
    if not run_id.isdigit():
        raise Http404("clone must be a run id")
    return get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=int(run_id))
