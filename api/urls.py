"""Routes of the REST API under /api/v1/."""
from django.urls import path, re_path
from rest_framework.routers import DefaultRouter

from api import health_views, views

router = DefaultRouter()
router.register("harnesses", views.HarnessViewSet, basename="harness")
router.register("harness-checks", views.HarnessCheckViewSet, basename="harnesscheck")
router.register("datasets", views.DatasetViewSet, basename="dataset")
router.register("tasks", views.TaskViewSet, basename="task")
router.register("reward-scripts", views.RewardScriptViewSet, basename="rewardscript")
router.register("runs", views.RunViewSet, basename="run")
router.register("rollouts", views.RolloutViewSet, basename="rollout")
router.register("models", views.ModelRegistryViewSet, basename="model")

urlpatterns = router.urls + [
    path("workers/", views.WorkersView.as_view(), name="workers"),
    re_path(r"^runs/(?P<run_id>-?[0-9]+)/alarms/$", health_views.RunAlarmsView.as_view(), name="api-run-alarms"),
    re_path(r"^runs/(?P<run_id>-?[0-9]+)/alarms/(?P<alarm_id>-?[0-9]+)/acknowledge/$", health_views.AlarmAcknowledgeView.as_view(),
         name="api-run-alarm-acknowledge"),
    re_path(r"^runs/(?P<run_id>-?[0-9]+)/rescores/$", health_views.RunRescoresView.as_view(), name="api-run-rescores"),
    re_path(r"^runs/(?P<run_id>-?[0-9]+)/rescores/(?P<rescore_id>-?[0-9]+)/$", health_views.RescoreDetailView.as_view(),
         name="api-run-rescore"),
]
