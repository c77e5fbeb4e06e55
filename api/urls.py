"""Routes of the REST API under /api/v1/."""
from django.urls import path
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
    path("runs/<int:run_id>/alarms/", health_views.RunAlarmsView.as_view(), name="api-run-alarms"),
    path("runs/<int:run_id>/alarms/<int:alarm_id>/acknowledge/", health_views.AlarmAcknowledgeView.as_view(),
         name="api-run-alarm-acknowledge"),
    path("runs/<int:run_id>/rescores/", health_views.RunRescoresView.as_view(), name="api-run-rescores"),
    path("runs/<int:run_id>/rescores/<int:rescore_id>/", health_views.RescoreDetailView.as_view(),
         name="api-run-rescore"),
]
