"""Harness pages: the list, create, the page of one (its runs and the edit form), delete when unused."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_POST

from runs import selectors, services
from runs.models import Harness, Run
from runs.pages.resource_forms import HarnessForm, placeholders

PER_PAGE = 50
RUNS_SHOWN = 50


@login_required
def harness_list(request):
    harnesses = (selectors.owned(Harness.objects.all(), request.user)
                 .annotate(run_count=Count("runs")).order_by("name", "pk"))
    page = Paginator(harnesses, PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "resources/harness_list.html", {"page": page})


@login_required
def harness_new(request):
    form = HarnessForm(request.POST or None, owner=request.user)
    if request.method == "POST" and form.is_valid():
        harness = services.create_harness(request.user, **form.validated)
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
            harness = services.update_harness(harness, **form.validated)
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
        services.delete_harness(harness, request.user)
    except services.ServiceError as exc:
        form = HarnessForm(initial=HarnessForm.initial_of(harness), instance=harness, owner=harness.owner)
        return _detail(request, harness, form, action_error=str(exc), status=409)
    messages.success(request, f"Harness '{harness.name}' deleted.")
    return redirect("harness-list")


def _owned(request, harness_id: int) -> Harness:
    return get_object_or_404(selectors.owned(Harness.objects.all(), request.user), pk=harness_id)


def _detail(request, harness: Harness, form: HarnessForm, action_error: str = "", status: int = 200):
    runs = selectors.owned(Run.objects.filter(harness=harness), request.user).order_by("-created_at")
    context = {**_form_context(form, harness), "action_error": action_error, "run_count": runs.count(),
               "runs": runs.values("pk", "name", "status", "created_at", "harness_snapshot__version")[:RUNS_SHOWN]}
    return render(request, "resources/harness_detail.html", context, status=status)


def _form_context(form: HarnessForm, harness: Harness | None) -> dict:
    return {"form": form, "harness": harness, "placeholders": placeholders()}


urlpatterns = [
    path("harnesses/", harness_list, name="harness-list"),
    path("harnesses/new/", harness_new, name="harness-new"),
    path("harnesses/<int:harness_id>/", harness_detail, name="harness-detail"),
    path("harnesses/<int:harness_id>/delete/", harness_delete, name="harness-delete"),
]
