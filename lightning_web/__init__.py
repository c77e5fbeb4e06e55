"""lightning-web: the Django project (settings, urls, ASGI routing, Celery app, the `up` supervisor)."""
from lightning_web.celery import app as celery_app

__all__ = ("celery_app",)
