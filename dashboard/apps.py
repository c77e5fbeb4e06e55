"""The dashboard app: the read side (pages, queries, summaries, token view, export/import, live websockets)."""
from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
