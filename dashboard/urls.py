"""Dashboard pages: the runs list, a run's page and inspector, rollouts, tokens, comparison, export, workers, and
the new-run form."""
from django.urls import path

from dashboard.pages import (compare, export_views, health_pages, new_run, rollout_page, run_inspect, run_list, run_page,
                             token_view, workers)

urlpatterns = [
    path("runs/new/", new_run.new_run, name="run-new"),
    *compare.urlpatterns,  # before run_page: runs/compare/ is not a run id
    *run_list.urlpatterns,
    *run_page.urlpatterns,
    *health_pages.urlpatterns,
    *rollout_page.urlpatterns,
    *token_view.urlpatterns,
    *run_inspect.urlpatterns,
    *export_views.urlpatterns,
    *workers.urlpatterns,
]
