"""Server-rendered dashboard pages (login required); data comes from selectors, live updates over websockets."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render

from catalog import selectors
from catalog.models import Dataset, Harness, RewardScript
from common import errors as common_errors
from dashboard.forms import RunForm
from runs import presets, services
from runs.models import Run
from trainer.config import TrainerConfig


@login_required
def new_run(request):
    """Launch a run: the same validation as the API (TrainerConfig, registry, ownership) through services.

    `?clone=<id>` fills the form from one of the user's runs ("Clone and edit") and records it as the origin;
    `?preset=<slug>` fills it from a preset (runs.presets) and shows its attempts per task and temperature beside
    the signal share of the user's last run of it.
    """
    clone = _clone_source(request)
    preset = _preset(request)
    form = RunForm(request.user, request.POST or None, clone=clone, preset=preset)
    if request.method == "POST" and form.is_valid():
        try:
            run = services.create_run(request.user, **form.run_arguments(), cloned_from=clone)
        except common_errors.ServiceError as exc:
            form.add_service_error(exc)
        else:
            return redirect("run-detail", run_id=run.pk)
    return render(request, "runs/new.html", {"form": form, "clone": clone, **_preset_context(request, preset)})


def _preset(request) -> presets.Preset | None:
    slug = request.GET.get("preset")
    if not slug:
        return None
    found = presets.find(slug)
    if found is None:
        raise Http404(f"no preset {slug!r}")
    return found


def _preset_context(request, preset: presets.Preset | None) -> dict:
    context = {"presets": presets.all_presets(), "preset": preset}
    if preset is not None:
        config = {**TrainerConfig().to_dict(), **preset.config}
        context["preset_facts"] = {
            "group_size": config["group_size"], "temperature": config["temperature"],
            "dynamic_sampling": config["dynamic_sampling"], "tasks_per_step": config["tasks_per_step"],
            "last": presets.last_run_signal(request.user, preset.slug),
            "missing": [f"{kind} {name!r}" for kind, model, name in (
                ("harness", Harness, preset.harness), ("dataset", Dataset, preset.dataset),
                ("reward script", RewardScript, preset.reward_script))
                if not selectors.owned(model.objects.all(), request.user).filter(name=name).exists()]}
    return context


def _clone_source(request) -> Run | None:
    run_id = request.GET.get("clone")
    if run_id is None:
        return None
    if not run_id.isdigit():
        raise Http404("clone must be a run id")
    return get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=int(run_id))
