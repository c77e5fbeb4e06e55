"""The runs app: a run's life (state machine, orchestrator, evaluation, durability, pools, workers), its rollouts,
recorded calls, samples, metrics and events, and harness checks."""
from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    default_auto_field = "django.db.models.BigAutoField"
