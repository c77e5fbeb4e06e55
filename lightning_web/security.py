"""The Content-Security-Policy middleware: django-csp's, with the dashboard's websocket allowed to its own host only."""
from __future__ import annotations

from csp.middleware import CSPMiddleware, PolicyParts
from django.core.exceptions import DisallowedHost


def websocket_sources(request) -> list[str]:
    """ws:// and wss:// to the host and port the page was served from ([] for a host ALLOWED_HOSTS refuses).

    'self' covers them in current Chromium and Firefox (CSP 3), not in every browser still in use; a bare `ws:`
    would let a script open a socket to any host. `get_host` has validated the host's syntax: no `;` or space
    gets into the header."""
    try:
        host = request.get_host()
    except DisallowedHost:
        return []
    return [f"ws://{host}", f"wss://{host}"]


class SameHostCSPMiddleware(CSPMiddleware):
    """Sets the policy of settings.CONTENT_SECURITY_POLICY, its connect-src extended by `websocket_sources`."""

    def get_policy_parts(self, request, response, report_only: bool = False) -> PolicyParts:
        parts = super().get_policy_parts(request, response, report_only)
        sources = websocket_sources(request)
        if sources:
            update = dict(parts.update or {})
            update["connect-src"] = [*_as_list(update.get("connect-src")), *sources]
            parts.update = update
        return parts


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)
