"""Object permissions: owners (and staff) only."""
from rest_framework.permissions import BasePermission


class IsOwnerOrStaff(BasePermission):
    """Querysets already hide others' rows (404); this guards objects reached any other way."""

    def has_object_permission(self, request, view, obj):
        owner_id = getattr(obj, "owner_id", None)
        return request.user.is_staff or owner_id == request.user.pk
