"""Refusals of the services, one class per kind; the API maps each to its status (api.errors)."""
from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A request the domain refuses; the message says why and what to do."""


class InvalidTransition(ServiceError):
    pass


class NotOwned(ServiceError):
    pass


class InvalidModel(ServiceError):
    """A run's `model` the registry cannot resolve or the user may not use; the API shows it on that field."""

    field = "model"


class InUse(ServiceError):
    """A harness, dataset or reward script that runs reference cannot be deleted."""


class DatasetRejected(ServiceError):
    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = errors
        first = errors[0]
        if first["line"] == 0:
            message = f"{first['error']}; nothing was saved"
        else:
            message = (f"the upload has {len(errors)} bad line(s); nothing was saved. "
                       f"First: line {first['line']}: {first['error']}")
        super().__init__(message)
