"""JSON Lines for the API's streamed exports: the media type a client may ask for; an error body is one line."""
from __future__ import annotations

from rest_framework.renderers import JSONRenderer


class JSONLinesRenderer(JSONRenderer):
    """`Accept: application/jsonl` on an export; the streamed body is written by dashboard.export, not rendered here."""

    media_type = "application/jsonl"
    format = "jsonl"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return super().render(data, accepted_media_type, renderer_context) + b"\n"
