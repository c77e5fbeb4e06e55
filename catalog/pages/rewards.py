"""Reward-script pages: the list, the code editor with its test panel, save as a new version, delete when unused."""
from __future__ import annotations

import json
import time

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path, reverse
from django.views.decorators.http import require_GET, require_POST

from catalog import reward_tests, selectors
from catalog import services as catalog_services
from catalog.models import Dataset, RewardScript, Task
from catalog.pages.resource_forms import STARTER_SOURCE, RewardForm, RewardTestForm, error_line
from common import errors as common_errors
from runs.models import Run

PER_PAGE = 50
RUNS_SHOWN = 50
TASKS_FOUND = 20


@login_required
def reward_list(request):
    scripts = (selectors.owned(RewardScript.objects.all(), request.user)
               .annotate(run_count=Count("runs")).order_by("name", "pk").defer("source"))
    page = Paginator(scripts, PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "resources/reward_list.html", {"page": page})


@login_required
def reward_new(request):
    form = RewardForm(request.POST or None, owner=request.user,
                      initial={"source": STARTER_SOURCE, "timeout_s": 10})
    if request.method == "POST" and form.is_valid():
        script = catalog_services.create_reward_script(request.user, **form.validated)
        messages.success(request, f"Reward script '{script.name}' created (version {script.version}).")
        return redirect("reward-detail", script_id=script.pk)
    return render(request, "resources/reward_form.html", _editor_context(request, form, None))


@login_required
def reward_detail(request, script_id: int):
    script = _owned(request, script_id)
    if request.method == "POST":
        form = RewardForm(request.POST, instance=script, owner=script.owner)
        if form.is_valid():
            before = script.version
            script = catalog_services.update_reward_script(script, **form.validated)
            messages.success(request, f"Saved as version {script.version}." if script.version != before
                             else "Saved; nothing a run uses changed, so the version stays.")
            return redirect("reward-detail", script_id=script.pk)
    else:
        form = RewardForm(initial=RewardForm.initial_of(script), instance=script, owner=script.owner)
    return _detail(request, script, form)


@login_required
@require_POST
def reward_delete(request, script_id: int):
    script = _owned(request, script_id)
    try:
        catalog_services.delete_reward_script(script, request.user)
    except common_errors.ServiceError as exc:
        form = RewardForm(initial=RewardForm.initial_of(script), instance=script, owner=script.owner)
        return _detail(request, script, form, action_error=str(exc), status=409)
    messages.success(request, f"Reward script '{script.name}' deleted.")
    return redirect("reward-list")


@login_required
@require_POST
def reward_test(request):
    """Queue a test of the source in the editor (saved or not) on a task and a typed outcome, scored on a worker as
    a run would score it (catalog.reward_tests: the web process runs no user code).

    JSON in: source, timeout_s, task_source ("dataset" with dataset and task, or "json" with task_json), outcome.
    JSON out: 202 {"test", "status": "queued", "url"}: GET `url` for the result (reward_test_result); 400 with
    per-field errors when the request itself is wrong.
    """
    try:
        body = json.loads(request.body or b"{}")
    except ValueError:
        return JsonResponse({"errors": {"__all__": ["the request body is not JSON"]}}, status=400)
    form = RewardTestForm(request.user, body if isinstance(body, dict) else {})
    if not form.is_valid():
        errors = {name: [e["message"] for e in found] for name, found in form.errors.get_json_data().items()}
        return JsonResponse({"errors": errors}, status=400)
    data = form.cleaned_data
    test_id = reward_tests.queue_test(request.user, {
        "source": data["source"], "timeout_s": data["timeout_s"], "task": data["task_data"],
        "task_label": data["task_label"], "outcome": data["outcome_data"]})
    return JsonResponse({"test": test_id, "status": "queued",
                         "url": reverse("reward-test-result", args=[test_id])}, status=202)


@login_required
@require_GET
def reward_test_result(request, test_id: str):
    """A queued test: 202 {"status": "queued" | "running", "waited_s"} until a worker scored it, then 200 with the
    sandbox's result (ok, reward, detail, output, error, kind), the error's line in the source, and the task and
    outcome reward() received; 404 for a test that is not the user's or has expired."""
    entry = reward_tests.read_test(request.user, test_id)
    if entry is None:
        return JsonResponse({"error": "no such test (tests are kept 15 minutes)"}, status=404)
    if entry["status"] != "done":
        return JsonResponse({"test": test_id, "status": entry["status"],
                             "waited_s": round(time.time() - entry["queued_at"], 1)}, status=202)
    result, asked = entry["result"], entry["request"]
    return JsonResponse({**result, "line": error_line(result["error"]), "task": asked["task"],
                         "task_label": asked["task_label"], "outcome": asked["outcome"]})


@login_required
@require_GET
def reward_tasks(request):
    """The test panel's task search: up to TASKS_FOUND of a dataset's tasks whose id contains `q` (or index is q)."""
    datasets = selectors.owned(Dataset.objects.all(), request.user)
    dataset_id = request.GET.get("dataset") or ""
    dataset = get_object_or_404(datasets, pk=int(dataset_id) if dataset_id.isdigit() else 0)
    tasks = Task.objects.filter(dataset=dataset).order_by("index")
    query = (request.GET.get("q") or "").strip()
    if query:
        matches = tasks.filter(external_id__icontains=query)
        tasks = (matches | tasks.filter(index=int(query))) if query.isdigit() else matches
    rows = list(tasks.values("index", "external_id", "split")[:TASKS_FOUND])
    return JsonResponse({"dataset": dataset.pk, "count": dataset.train_count + dataset.val_count, "tasks": rows})


def _owned(request, script_id: int) -> RewardScript:
    return get_object_or_404(selectors.owned(RewardScript.objects.all(), request.user), pk=script_id)


def _detail(request, script: RewardScript, form: RewardForm, action_error: str = "", status: int = 200):
    runs = selectors.owned(Run.objects.filter(reward_script=script), request.user).order_by("-created_at")
    context = {**_editor_context(request, form, script), "action_error": action_error, "run_count": runs.count(),
               "runs": runs.values("pk", "name", "status", "created_at", "reward_snapshot__version")[:RUNS_SHOWN]}
    return render(request, "resources/reward_detail.html", context, status=status)


def _editor_context(request, form: RewardForm, script: RewardScript | None) -> dict:
    datasets = selectors.owned(Dataset.objects.all(), request.user).order_by("name").values(
        "pk", "name", "train_count", "val_count")
    return {"form": form, "script": script, "datasets": list(datasets)}


urlpatterns = [
    path("reward-scripts/", reward_list, name="reward-list"),
    path("reward-scripts/new/", reward_new, name="reward-new"),
    path("reward-scripts/test/", reward_test, name="reward-test"),
    path("reward-scripts/test/<str:test_id>/", reward_test_result, name="reward-test-result"),
    path("reward-scripts/tasks/", reward_tasks, name="reward-tasks"),
    path("reward-scripts/<int:script_id>/", reward_detail, name="reward-detail"),
    path("reward-scripts/<int:script_id>/delete/", reward_delete, name="reward-delete"),
]
