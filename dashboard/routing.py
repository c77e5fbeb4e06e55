"""Websocket URL routes."""
from django.urls import path

from dashboard.consumers import RunEventsConsumer, RunsFeedConsumer

websocket_urlpatterns = [
    path("ws/runs/", RunsFeedConsumer.as_asgi()),
    path("ws/runs/<int:run_id>/", RunEventsConsumer.as_asgi()),
]
