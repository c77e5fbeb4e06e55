"""Routes of the REST API under /api/v1/."""
from django.urls import path
from rest_framework.routers import DefaultRouter

from api import views

router = DefaultRouter()
router.register("harnesses", views.HarnessViewSet, basename="harness")
router.register("harness-checks", views.HarnessCheckViewSet, basename="harnesscheck")
router.register("datasets", views.DatasetViewSet, basename="dataset")
router.register("tasks", views.TaskViewSet, basename="task")
router.register("reward-scripts", views.RewardScriptViewSet, basename="rewardscript")
router.register("runs", views.RunViewSet, basename="run")
router.register("rollouts", views.RolloutViewSet, basename="rollout")
router.register("models", views.ModelRegistryViewSet, basename="model")

urlpatterns = router.urls + [path("workers/", views.WorkersView.as_view(), name="workers")]
