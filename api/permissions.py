"""Object permissions: owners (and staff) only."""
from rest_framework.permissions import BasePermission

from catalog import selectors


class IsOwnerOrStaff(BasePermission):
    """Querysets already hide others' rows (404); this guards objects reached any other way."""

    def has_object_permission(self, request, view, obj):
        # A task, rollout, call or sample is owned through its dataset or run (selectors.OWNER_PATHS).
        return request.user.is_staff or selectors.owner_id_of(obj) == request.user.pk
