"""The health app: alarms a run's steps raise (silent failures a healthy-looking curve hides), the reward-hacking
lens on rollouts, and re-scoring a run's stored rollouts with another reward script."""
from django.apps import AppConfig


class HealthConfig(AppConfig):
    name = "health"
    default_auto_field = "django.db.models.BigAutoField"
