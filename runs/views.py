"""Server-rendered dashboard pages (login required); data comes from selectors, live updates over websockets."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render

from runs import selectors, services
from runs.forms import RunForm
from runs.models import Run


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
