"""Database functions the apps share (Django ORM expressions, no models)."""
from __future__ import annotations

from django.db.models import Func, IntegerField


class JsonArrayLength(Func):
    """The length of a JSON array column, computed by the database (the array itself is never read)."""

    function = "JSON_ARRAY_LENGTH"  # SQLite's JSON1
    output_field = IntegerField()

    def as_postgresql(self, compiler, connection, **extra):
        return super().as_sql(compiler, connection, function="JSONB_ARRAY_LENGTH", **extra)

    def as_mysql(self, compiler, connection, **extra):
        return super().as_sql(compiler, connection, function="JSON_LENGTH", **extra)
