"""Dashboard pages: the new-run form here, each area's pages in runs/pages/."""
from django.urls import path

from runs import views
from runs.pages import (compare, datasets, export_views, harnesses, models, rewards, rollout_page, run_inspect,
                        run_list, run_page, token_view, workers)

urlpatterns = [
    path("runs/new/", views.new_run, name="run-new"),
    *compare.urlpatterns,  # before run_page: runs/compare/ is not a run id
    *run_list.urlpatterns,
    *run_page.urlpatterns,
    *rollout_page.urlpatterns,
    *token_view.urlpatterns,
    *run_inspect.urlpatterns,
    *export_views.urlpatterns,
    *harnesses.urlpatterns,
    *rewards.urlpatterns,
    *datasets.urlpatterns,
    *models.urlpatterns,
    *workers.urlpatterns,
]
