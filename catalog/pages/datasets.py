"""Dataset pages: the list, the upload form, a dataset's page with its task browser, delete."""
from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db import IntegrityError
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_POST

from catalog import selectors
from catalog import services as catalog_services
from catalog.models import Dataset, Split, Task
from catalog.pages.dataset_forms import DatasetUploadForm
from common import errors as common_errors

TASKS_PER_PAGE = 25


@login_required
def dataset_list(request):
    datasets = (selectors.owned(Dataset.objects.all(), request.user).select_related("owner")
                .annotate(run_count=Count("runs")).order_by("-created_at"))
    return render(request, "resources/dataset_list.html", {"datasets": datasets})


@login_required
def dataset_new(request):
    """Upload a file; a bad file lists every bad line with its number, saves nothing and keeps the other fields."""
    form = DatasetUploadForm(request.user, request.POST or None, request.FILES or None)
    line_errors: list[dict] = []
    if request.method == "POST" and form.is_valid():
        try:
            dataset = catalog_services.create_dataset(request.user, **form.dataset_arguments())
        except common_errors.DatasetRejected as exc:
            line_errors = [e for e in exc.errors if e["line"]]
            form.add_error("file", f"{len(line_errors)} bad line(s), listed below: nothing was saved"
                           if line_errors else str(exc))
        except IntegrityError:  # the same name uploaded twice at once: the constraint decides
            form.add_error("name", f"you already have a dataset named {form.cleaned_data['name']!r}")
        except common_errors.ServiceError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Dataset {dataset.name!r} uploaded: {dataset.train_count} train and "
                                      f"{dataset.val_count} val tasks.")
            return redirect("dataset-detail", dataset_id=dataset.pk)
    # A form with errors is sent back with 200, as Django forms do (a 4xx would log an error in the console).
    return render(request, "resources/dataset_new.html",
                  {"form": form, "line_errors": line_errors, "errors_capped": len(line_errors) >= 200})


@login_required
def dataset_detail(request, dataset_id: int):
    dataset = get_object_or_404(selectors.owned(Dataset.objects.all(), request.user).annotate(run_count=Count("runs")),
                                pk=dataset_id)
    split = request.GET.get("split", "")
    split = split if split in Split.values else ""
    query = request.GET.get("q", "").strip()[:200]
    page = Paginator(selectors.browse_tasks(dataset, split, query), TASKS_PER_PAGE).get_page(request.GET.get("page"))
    hidden = dataset.reward_only_fields
    return render(request, "resources/dataset_detail.html", {
        "dataset": dataset, "split": split, "q": query, "page": page,
        "tasks": [shown_task(task, hidden) for task in page.object_list],
        "page_links": page_links(page, {"split": split, "q": query}),
        "splits": Split.choices,
    })


@login_required
@require_POST
def dataset_delete(request, dataset_id: int):
    dataset = get_object_or_404(selectors.owned(Dataset.objects.all(), request.user), pk=dataset_id)
    try:
        catalog_services.delete_dataset(dataset, request.user)
    except common_errors.ServiceError as exc:
        messages.error(request, f"Not deleted: {exc}")
        return redirect("dataset-detail", dataset_id=dataset.pk)
    messages.success(request, f"Dataset {dataset.name!r} deleted.")
    return redirect("dataset-list")


@dataclass(frozen=True)
class Chunk:
    text: str
    reward_only: bool = False


@dataclass(frozen=True)
class ShownTask:
    index: int
    external_id: str
    split: str
    chunks: list[Chunk]
    reward_only_keys: list[str]


def shown_task(task: Task, hidden: list[str]) -> ShownTask:
    return ShownTask(task.index, task.external_id, task.split, json_chunks(task.data, set(hidden)),
                     [key for key in hidden if key in task.data] if isinstance(task.data, dict) else [])


def json_chunks(data, hidden: set[str]) -> list[Chunk]:
    """`json.dumps(data, indent=2)` in pieces, each top-level reward-only field its own piece (marked in the page)."""
    if not isinstance(data, dict) or not data:
        return [Chunk(json.dumps(data, indent=2, ensure_ascii=False))]
    chunks = [Chunk("{\n")]
    last = len(data) - 1
    for i, (key, value) in enumerate(data.items()):
        body = json.dumps(value, indent=2, ensure_ascii=False).replace("\n", "\n  ")
        text = f"  {json.dumps(key, ensure_ascii=False)}: {body}"
        chunks.append(Chunk(text, reward_only=key in hidden))
        chunks.append(Chunk(",\n" if i < last else "\n"))
    chunks.append(Chunk("}"))
    return chunks


def page_links(page, params: dict[str, str]) -> list[dict]:
    """Links to the first, last and nearby pages (None marks a gap), each keeping the filters."""
    kept = {key: value for key, value in params.items() if value}
    numbers = page.paginator.get_elided_page_range(page.number, on_each_side=2, on_ends=1)
    return [{"number": n, "current": n == page.number,
             "url": None if n == page.paginator.ELLIPSIS else "?" + urlencode({**kept, "page": n})}
            for n in numbers]


urlpatterns = [
    path("datasets/", dataset_list, name="dataset-list"),
    path("datasets/upload/", dataset_new, name="dataset-new"),
    path("datasets/<int:dataset_id>/", dataset_detail, name="dataset-detail"),
    path("datasets/<int:dataset_id>/delete/", dataset_delete, name="dataset-delete"),
]
