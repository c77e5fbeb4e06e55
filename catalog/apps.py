"""The catalog app: what a user defines before a run (harnesses, datasets, reward scripts, the models registry)."""
from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "catalog"
    default_auto_field = "django.db.models.BigAutoField"
