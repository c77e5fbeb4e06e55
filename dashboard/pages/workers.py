"""The workers page: the live Celery workers, their pools, heartbeats and the runs they hold (runs.worker_status)."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.urls import path
from django.views.decorators.http import require_GET

from runs import pools, worker_status


@login_required
@require_GET
def worker_list(request):
    return render(request, "runs/workers.html", {
        "status": worker_status.inspect_workers(request.user), "pools": pools.queued_per_pool(),
        "default_queue": pools.DEFAULT_QUEUE,
    })


urlpatterns = [path("workers/", worker_list, name="worker-list")]
