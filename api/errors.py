"""The API's one exception handler: DRF errors and service refusals in one shape with a readable message."""
from __future__ import annotations

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import IntegrityError
from django.http import Http404
from drf_spectacular.openapi import AutoSchema
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

from common.errors import DatasetRejected, InUse, InvalidTransition, NotOwned, ServiceError


def exception_handler(exc, context):
    """Body: {"error": {"status", "code", "message", "fields"?, "lines"?}}."""
    if isinstance(exc, DatasetRejected):
        return _respond(status.HTTP_400_BAD_REQUEST, "invalid_dataset", str(exc), lines=exc.errors)
    if isinstance(exc, InvalidTransition):
        return _respond(status.HTTP_409_CONFLICT, "invalid_transition", str(exc))
    if isinstance(exc, InUse):
        return _respond(status.HTTP_409_CONFLICT, "in_use", str(exc))
    if isinstance(exc, NotOwned):
        return _respond(status.HTTP_400_BAD_REQUEST, "not_owned", str(exc))
    if isinstance(exc, ServiceError):
        field = getattr(exc, "field", None)  # a refusal about one input field: shown there, like a serializer's
        return _respond(status.HTTP_400_BAD_REQUEST, "invalid", f"{field}: {exc}" if field else str(exc),
                        **({"fields": {field: [str(exc)]}} if field else {}))
    if isinstance(exc, IntegrityError):  # a race past the serializers' checks, e.g. two creates of one name
        return _respond(status.HTTP_409_CONFLICT, "conflict", "the change conflicts with data saved meanwhile "
                        "(a name already taken?); reload and try again")
    response = drf_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, (Http404, DjangoPermissionDenied)):
        exc = exceptions.NotFound() if isinstance(exc, Http404) else exceptions.PermissionDenied()
    code = getattr(exc, "default_code", "error")
    if isinstance(exc, exceptions.ValidationError) and isinstance(response.data, (dict, list)):
        return _respond(response.status_code, "invalid", _summary(response.data), fields=response.data,
                        headers=response.headers)
    message = response.data.get("detail", str(exc)) if isinstance(response.data, dict) else str(exc)
    return _respond(response.status_code, code, str(message), headers=response.headers)


def _respond(status_code, code, message, headers=None, **extra):
    body = {"error": {"status": status_code, "code": code, "message": message, **extra}}
    response = Response(body, status=status_code)
    for name, value in (headers or {}).items():
        if name.lower() in ("www-authenticate", "retry-after", "allow"):
            response[name] = value
    return response


def _summary(data, prefix="") -> str:
    """'field: first message; other: ...' for a DRF error structure."""
    parts = []
    if isinstance(data, dict):
        for key, value in data.items():
            label = key if key != "non_field_errors" else ""
            parts.append(_summary(value, f"{prefix}{label}" if label else prefix))
    elif isinstance(data, list):
        for item in data:
            parts.append(_summary(item, prefix))
    else:
        parts.append(f"{prefix}: {data}" if prefix else str(data))
    return "; ".join(p for p in parts if p)


class ErrorDetailSerializer(serializers.Serializer):
    status = serializers.IntegerField()
    code = serializers.CharField()
    message = serializers.CharField()
    fields = serializers.JSONField(required=False, help_text="Per-field messages of a validation error")
    lines = serializers.JSONField(required=False, help_text="Per-line messages of a rejected dataset")


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


ERROR_STATUSES = (400, 401, 403, 404, 405, 406, 409, 415, 429)
"""What the handler above can answer on any API operation: bad input, no or wrong credentials, someone else's row,
a method or media type the operation does not serve, a refused transition or a row in use, too many failed logins."""


class DocumentedErrorsSchema(AutoSchema):
    """AutoSchema that also documents the error answers, so the published schema is true of every response
    (schemathesis checks status codes and bodies against it) and clients know the error shape."""

    def _get_response_bodies(self, direction="response"):
        bodies = super()._get_response_bodies(direction)
        for code in map(str, ERROR_STATUSES):
            bodies.setdefault(code, self._get_response_for_code(ErrorSerializer, code, direction=direction))
        return bodies
