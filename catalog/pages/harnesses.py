"""Harness pages: the list (with the ready-made templates), create, the page of one (its runs, its checks and the
edit form), delete when unused, and the page of one harness check."""
from __future__ import annotations

import json

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_POST

from catalog import harness_templates, selectors
from catalog import services as catalog_services
from catalog.models import Dataset, Harness, RewardScript
from catalog.pages.resource_forms import HarnessForm, RewardTestForm, placeholders
from common import errors as common_errors
from runs import check_services
from runs.models import CheckEngine, HarnessCheck, Run

PER_PAGE = 50
RUNS_SHOWN = 50
CHECKS_SHOWN = 10


class HarnessCheckForm(RewardTestForm):
    """The 'Check this harness' form: the reward test panel's task choice (a dataset's task or typed JSON), the
    model and the engine that answers, and an optional reward script."""

    source = outcome = timeout_s = None  # the reward panel's editor and typed outcome: a check runs the harness
    model = forms.ChoiceField(help_text="The registry model: its tokenizer renders every prompt and answer")
    engine = forms.ChoiceField(choices=CheckEngine.choices, initial=CheckEngine.SCRIPTED,
                               help_text="Scripted: deterministic answers that edit the task's file, in seconds. "
                                         "vLLM: the model's own answers, as a run gets them (waits for the runs "
                                         "worker; minutes to start the engine)")
    reward_script = forms.ModelChoiceField(queryset=RewardScript.objects.none(), required=False,
                                           empty_label="none: no reward")

    def __init__(self, user, *args, **kwargs):
        kwargs.setdefault("auto_id", "check_%s")  # it shares the harness page with the edit form
        super().__init__(user, *args, **kwargs)
        self.task_row = None
        self.fields["model"].choices = [(name, name) for name in sorted(check_services.tokenizer_models())]
        self.fields["reward_script"].queryset = selectors.owned(RewardScript.objects.all(), user).order_by("name")

    def _dataset_task(self, dataset_id, ref):
        self.task_row = super()._dataset_task(dataset_id, ref)  # the row, so the check records where it came from
        return self.task_row

    def start(self, harness: Harness) -> HarnessCheck:
        data = self.cleaned_data
        task = self.task_row if data["task_source"] == "dataset" else data["task_data"]
        return check_services.start_harness_check(self.user, harness, task=task, model=data["model"],
                                                  reward_script=data["reward_script"], engine=data["engine"])


@login_required
def harness_list(request):
    harnesses = (selectors.owned(Harness.objects.all(), request.user)
                 .annotate(run_count=Count("runs")).order_by("name", "pk"))
    page = Paginator(harnesses, PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "resources/harness_list.html", {"page": page, "templates": _templates(request.user)})


def _templates(user) -> list[dict]:
    """The ready-made templates as the list shows them: whether the agent is installed, whether the user has one."""
    names = set(Harness.objects.filter(owner=user).values_list("name", flat=True))
    versions = harness_templates.installed_versions()  # one read of versions.json, not one per template
    return [{"template": t, "version": versions.get(t.tool), "added": t.slug in names}
            for t in harness_templates.templates()]


@login_required
@require_POST
def harness_template_add(request, slug: str):
    """Add a ready-made template as one of the user's harnesses (named after its slug)."""
    try:
        harness = harness_templates.add_for(request.user, slug)
    except KeyError:
        raise Http404(f"no harness template {slug!r}") from None
    except common_errors.ServiceError as exc:
        messages.error(request, str(exc))
        return redirect("harness-list")
    messages.success(request, f"Harness '{harness.name}' added from its template.")
    return redirect("harness-detail", harness_id=harness.pk)


@login_required
def harness_new(request):
    form = HarnessForm(request.POST or None, owner=request.user)
    if request.method == "POST" and form.is_valid():
        harness = catalog_services.create_harness(request.user, **form.validated)
        messages.success(request, f"Harness '{harness.name}' created (version {harness.version}).")
        return redirect("harness-detail", harness_id=harness.pk)
    return render(request, "resources/harness_form.html", _form_context(form, None))


@login_required
def harness_detail(request, harness_id: int):
    harness = _owned(request, harness_id)
    if request.method == "POST":
        form = HarnessForm(request.POST, instance=harness, owner=harness.owner)
        if form.is_valid():
            before = harness.version
            harness = catalog_services.update_harness(harness, **form.validated)
            messages.success(request, f"Saved as version {harness.version}." if harness.version != before
                             else "Saved; nothing a run uses changed, so the version stays.")
            return redirect("harness-detail", harness_id=harness.pk)
    else:
        form = HarnessForm(initial=HarnessForm.initial_of(harness), instance=harness, owner=harness.owner)
    return _detail(request, harness, form)


@login_required
@require_POST
def harness_delete(request, harness_id: int):
    harness = _owned(request, harness_id)
    try:
        catalog_services.delete_harness(harness, request.user)
    except common_errors.ServiceError as exc:
        form = HarnessForm(initial=HarnessForm.initial_of(harness), instance=harness, owner=harness.owner)
        return _detail(request, harness, form, action_error=str(exc), status=409)
    messages.success(request, f"Harness '{harness.name}' deleted.")
    return redirect("harness-list")


@login_required
@require_POST
def harness_check_new(request, harness_id: int):
    """Queue a check of the harness from its page's form; the form comes back with its errors when refused."""
    harness = _owned(request, harness_id)
    check_form = HarnessCheckForm(request.user, request.POST)
    if check_form.is_valid():
        try:
            check = check_form.start(harness)
        except common_errors.ServiceError as exc:
            check_form.add_error(None, str(exc))
        else:
            return redirect("harness-check", harness_id=harness.pk, check_id=check.pk)
    form = HarnessForm(initial=HarnessForm.initial_of(harness), instance=harness, owner=harness.owner)
    return _detail(request, harness, form, check_form=check_form, status=400)


@login_required
def harness_check(request, harness_id: int, check_id: int):
    """One check: its verdict in words, the recorded calls, the samples that would be trained and the outcome."""
    check = get_object_or_404(selectors.owned(HarnessCheck.objects.select_related("harness", "reward_script"),
                                              request.user), pk=check_id, harness_id=harness_id)
    report = check.report
    context = {"check": check, "harness": check.harness, "report": report,
               "drift": sorted((report.get("drift") or {}).items()),
               "samples": [{**sample, "context_tokens": sample["tokens"] - sample["trained_tokens"]}
                           for sample in report.get("samples", [])],
               "outcome_json": _pretty(report.get("outcome")),
               "reward_detail_json": _pretty((report.get("reward") or {}).get("detail")),
               "task_json": _pretty(check.harness_task())}
    return render(request, "resources/harness_check.html", context)


def _pretty(value) -> str:
    return "" if value is None else json.dumps(value, indent=2, ensure_ascii=False)


def _owned(request, harness_id: int) -> Harness:
    return get_object_or_404(selectors.owned(Harness.objects.all(), request.user), pk=harness_id)


def _detail(request, harness: Harness, form: HarnessForm, action_error: str = "", status: int = 200,
            check_form: HarnessCheckForm | None = None):
    runs = selectors.owned(Run.objects.filter(harness=harness), request.user).order_by("-created_at")
    checks = selectors.owned(harness.checks.all(), request.user)
    datasets = list(selectors.owned(Dataset.objects.all(), request.user).order_by("name"))
    context = {**_form_context(form, harness), "action_error": action_error, "run_count": runs.count(),
               "runs": runs.values("pk", "name", "status", "created_at", "harness_snapshot__version")[:RUNS_SHOWN],
               "check_form": check_form or _blank_check_form(request, harness, bool(datasets)),
               "checks": checks[:CHECKS_SHOWN], "datasets": datasets}
    return render(request, "resources/harness_detail.html", context, status=status)


def _blank_check_form(request, harness: Harness, has_datasets: bool) -> HarnessCheckForm:
    """A fresh check form; a harness made from a template gets that template's example task to type over."""
    try:
        example = harness_templates.load(harness.name).example_task
    except KeyError:
        example = None
    initial = {"task_source": "dataset" if has_datasets and not example else "json",
               "task_json": json.dumps(example, indent=2) if example else ""}
    return HarnessCheckForm(request.user, initial=initial)


def _form_context(form: HarnessForm, harness: Harness | None) -> dict:
    return {"form": form, "harness": harness, "placeholders": placeholders()}


urlpatterns = [
    path("harnesses/", harness_list, name="harness-list"),
    path("harnesses/new/", harness_new, name="harness-new"),
    path("harnesses/<int:harness_id>/", harness_detail, name="harness-detail"),
    path("harnesses/<int:harness_id>/delete/", harness_delete, name="harness-delete"),
    path("harnesses/<int:harness_id>/checks/", harness_check_new, name="harness-check-new"),
    path("harnesses/<int:harness_id>/checks/<int:check_id>/", harness_check, name="harness-check"),
    path("harnesses/templates/<slug:slug>/add/", harness_template_add, name="harness-template-add"),
]
