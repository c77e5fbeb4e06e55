"""Dashboard pages."""
from django.urls import path

from runs import views

urlpatterns = [
    path("", views.runs_list, name="runs-list"),
    path("runs/new/", views.new_run, name="run-new"),
    path("runs/demo/", views.start_demo, name="run-demo"),
    path("runs/<int:run_id>/", views.run_detail, name="run-detail"),
    path("runs/<int:run_id>/resume/", views.run_go_on, {"how": "resume"}, name="run-resume"),
    path("runs/<int:run_id>/continue/", views.run_go_on, {"how": "continue"}, name="run-continue"),
]
