"""The Celery app: Redis broker, settings from Django (CELERY_*), tasks discovered in the apps."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_web.settings")

app = Celery("lightning_web")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
