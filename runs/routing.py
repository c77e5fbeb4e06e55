"""Websocket URL routes."""
from django.urls import path

from runs.consumers import RunEventsConsumer

websocket_urlpatterns = [path("ws/runs/<int:run_id>/", RunEventsConsumer.as_asgi())]
