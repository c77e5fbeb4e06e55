"""Dashboard pages."""
from django.urls import path

from runs import views

urlpatterns = [
    path("", views.runs_list, name="runs-list"),
    path("runs/new/", views.new_run, name="run-new"),
    path("runs/<int:run_id>/", views.run_detail, name="run-detail"),
]
